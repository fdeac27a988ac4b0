"""CPU KV offload on a two-rank engine (gloo, two real processes, float32 on CPU): each rank offloads its own
heads' K/V, applying rank 0's spill and hot-buffer decisions (``OffloadStep``) before every forward, and the
engine serves a context beyond its device KV budget with the same greedy tokens as one rank without offload.

The budget is 15 device blocks of 16 tokens; the long prompt alone needs 20 (as tests/engine/offload).
"""

import random

import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import stop_parallel_engine
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.offload.layout import device_bytes_per_host_block, host_bytes_per_block
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

DEVICE_BLOCKS = 15
NEW_TOKENS = 12


def _generate(core) -> dict[str, list[int]]:
    rng = random.Random(1)
    prompts = {"long": [rng.randrange(380) for _ in range(300)], "short": [rng.randrange(380) for _ in range(60)]}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
    results = offline.generate(core, requests, check_invariants=True)
    return {rid: result.token_ids for rid, result in results.items()}


def test_two_ranks_offload_their_heads_with_the_same_tokens(tiny_model_dir) -> None:
    expected = _generate(build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=40, cpu_threads=1)))
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=DEVICE_BLOCKS, kv_offload_gb=0.001,
                          max_num_batched_tokens=64, cpu_threads=1,
                          parallel=ParallelConfig(tensor_parallel=2))  # fmt: skip
    core = build_engine_core(config)
    try:
        assert _generate(core) == expected
        stats = core.stats().offload
        assert stats is not None and stats.spilled_blocks > 0 and stats.hot_misses > 0 and stats.staged_bytes > 0
    finally:
        stop_parallel_engine(core)


def test_a_sized_parallel_cache_leaves_room_for_the_host_blocks_device_part(tiny_model_dir) -> None:
    """Sized from a KV budget (not an exact count), each rank's device tier gives up the index keys and dense K/V
    that its host blocks keep on the device, as one GPU's does: both tiers fit the budget.  ``--kv-offload-gb`` is
    the engine's: each of the two ranks pins half of it."""
    budget_gb, host_gb = 0.004, 0.002
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_gb=budget_gb, kv_offload_gb=host_gb, cpu_threads=1,
                          parallel=ParallelConfig(tensor_parallel=2))  # fmt: skip
    core = build_engine_core(config)
    try:
        spec = core.runner.model.kv_cache_spec(torch.float32)
        kv = core.scheduler.kv
        device_blocks, host_blocks = kv.pool.num_usable_blocks + 1, kv.host.num_blocks
        assert host_blocks == int(host_gb / 2 * 2**30 // host_bytes_per_block(spec)) > 0
        used = device_blocks * spec.bytes_per_page + host_blocks * device_bytes_per_host_block(spec)
        assert budget_gb * 2**30 - 2 * spec.bytes_per_page < used <= budget_gb * 2**30  # two rounding steps
    finally:
        stop_parallel_engine(core)
