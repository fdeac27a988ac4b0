"""CPU KV offload end to end on the tiny model: the same greedy tokens as without it, a context larger than the
device's KV budget served, the pools whole again afterwards, and the counters moving (from zero after the warm-up).

The "device" here is the CPU (the device KV tensors and the host pool are separate CPU tensors) and attention
is the reference backend, which reads host blocks through the same hot-buffer rules as the GPU kernels
(``engine.offload.resolver.resolve_request``).  The device budget is 15 blocks of 16 tokens; the long prompt
alone needs 20.
"""

import random
from dataclasses import fields

import pytest

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.engine.runtime.warmup import SPLIT_CONTEXT_BLOCKS, warm_up
from m3stack.engine.server.metrics import EngineMetrics

DEVICE_BLOCKS = 15
NEW_TOKENS = 12


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1)
    return {"long": [rng.randrange(380) for _ in range(300)], "short": [rng.randrange(380) for _ in range(60)]}


def _generate(core) -> dict[str, list[int]]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in _prompts().items()]
    results = offline.generate(core, requests, check_invariants=True)
    return {rid: result.token_ids for rid, result in results.items()}


@pytest.fixture(scope="module")
def without_offload(tiny_model_dir) -> dict[str, list[int]]:
    return _generate(build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=40)))


def _offload_core(model_dir, **overrides):
    settings = {"num_kv_blocks": DEVICE_BLOCKS, "kv_offload_gb": 0.001, "max_num_batched_tokens": 64, **overrides}
    config = EngineConfig(model=str(model_dir), **settings)
    return build_engine_core(config)


def test_offload_serves_a_context_beyond_the_device_with_the_same_tokens(tiny_model_dir, without_offload):
    plain = build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=DEVICE_BLOCKS))
    with pytest.raises(InvalidRequestError):  # without offload the long prompt does not fit
        build_request(plain.info, "long", _prompts()["long"], SamplingParams(temperature=0.0, max_new_tokens=1))
    assert -(-(len(_prompts()["long"]) + NEW_TOKENS) // 16) > DEVICE_BLOCKS
    core = _offload_core(tiny_model_dir)
    assert _generate(core) == without_offload
    stats = core.stats().offload
    assert stats is not None and stats.spilled_blocks > 0 and stats.spill_bytes > 0
    assert stats.hot_hits > 0 and stats.hot_misses > 0 and stats.miss_bytes == stats.hot_misses * 2 * 2 * 16 * 32 * 4
    assert stats.staged_bytes > 0  # prefill chunks after the first spill read host blocks
    assert 0 < stats.churned_blocks < stats.selected_blocks
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks and stats.host_blocks_used == 0
    assert stats.hot_buffers == 0
    metrics = EngineMetrics(core.info.served_model_name, core.info.max_model_len)
    metrics.on_stats(core.stats())
    sample = metrics.registry.get_sample_value
    assert sample("m3stack_engine_offload_spilled_blocks_total") == stats.spilled_blocks
    assert sample("m3stack_engine_offload_hot_buffer_misses_total") == stats.hot_misses
    assert sample("m3stack_engine_offload_host_kv_cache_usage_perc") == 0.0


def test_async_scheduling_without_prefix_caching_gives_the_same_tokens(tiny_model_dir, without_offload):
    core = _offload_core(tiny_model_dir, async_scheduling=True, enable_prefix_caching=False)
    assert _generate(core) == without_offload
    assert core.stats().offload.spilled_blocks > 0


def test_offload_over_fp8_caches_gives_the_tokens_of_the_same_caches_without_offload(tiny_model_dir):
    """``--index-dtype fp8_e4m3 --kv-cache-dtype fp8_e4m3``: spilled blocks' fp8 K/V go to the host pool, their raw
    index pages (keys and scales) stay on the device under their host ids; the engine with offload serves the tokens
    of the same fp8 engine without it."""
    fp8 = {"index_dtype": "fp8_e4m3", "kv_cache_dtype": "fp8_e4m3"}
    plain = _generate(build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=40, **fp8)))
    assert _generate(_offload_core(tiny_model_dir, **fp8)) == plain


def test_bad_offload_settings_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="below the 6 blocks"):
        _offload_core(tiny_model_dir, kv_offload_hot_blocks=5)
    with pytest.raises(ValueError, match="no MSA layer"):
        _offload_core(tiny_model_dir, attention="dense")


def test_a_chunk_budget_beyond_the_device_is_capped_to_what_fits(tiny_model_dir, without_offload):
    """512 batched tokens are 32 blocks against 15 on the device: a first chunk that large could never be placed,
    so the scheduler caps every chunk at what the device holds next to a hot buffer and the kept tail."""
    core = _offload_core(tiny_model_dir, max_num_batched_tokens=512)
    assert core.scheduler.kv.max_chunk_tokens < 512
    assert _generate(core) == without_offload
    assert core.stats().offload.spilled_blocks > 0


def test_requests_too_short_to_spill_wait_for_device_room_instead_of_being_preempted(tiny_model_dir):
    """Six 60-token requests need 5 blocks each, 30 in all, on a 14-block device: none can pay for a hot
    buffer, so host slots are no room for them; they are admitted as the device frees up, never preempted."""
    rng = random.Random(5)
    prompts = {f"s{i}": [rng.randrange(380) for _ in range(60)] for i in range(6)}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    def generate(core) -> dict[str, list[int]]:
        requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
        return {rid: r.token_ids for rid, r in offline.generate(core, requests, check_invariants=True).items()}

    plain = generate(build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=60)))
    core = _offload_core(tiny_model_dir)
    assert core.scheduler.kv.hot_blocks >= 5 - core.scheduler.kv.keep_tail_blocks
    assert generate(core) == plain
    assert core.scheduler.num_preemptions == 0


def test_the_warm_up_leaves_offload_counters_at_zero(tiny_model_dir):
    """The warm-up's long context (160 blocks, on a 15-block device) spills and reads host blocks; afterwards the
    counters start from zero and count the same requests exactly as a fresh engine's do."""
    settings = {"kv_offload_gb": 0.008, "max_num_batched_tokens": 512}  # host room for the long part, few chunks
    fresh, warmed = _offload_core(tiny_model_dir, **settings), _offload_core(tiny_model_dir, **settings)
    assert SPLIT_CONTEXT_BLOCKS > DEVICE_BLOCKS and warm_up(warmed).split_keys
    stats = warmed.stats().offload
    assert stats is not None and stats.host_blocks > 0
    # Every field but the pool's size: the counters, and the gauges of an idle engine.
    counters = {field.name: getattr(stats, field.name) for field in fields(stats) if field.name != "host_blocks"}
    assert counters == dict.fromkeys(counters, 0)
    assert _generate(warmed) == _generate(fresh)
    counted = fresh.stats().offload
    assert warmed.stats().offload == counted
    assert counted.spilled_blocks > 0 and counted.hot_misses > 0 and counted.staged_bytes > 0
