"""The engine runtime on the GPU (tiny checkpoint, GPU attention backend): the CPU suite's invariance checks, the
engine against transformers, async scheduling and CUDA-graph decode against plain eager steps.

float32 with TF32 off, so different cuts of the same work agree to the last bit that matters for argmax.
"""

import json
import random

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration

from m3stack.engine import kernel_compiles
from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.core import assemble_engine_core
from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("exact_float32")


def _core(**overrides):
    settings = {
        "model": str(ensure_tiny_checkpoint()),
        "device": "cuda",
        "dtype": "float32",
        "num_kv_blocks": 512,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 16,
        "cuda_graphs": False,
        "async_scheduling": False,
        **overrides,
    }
    core = build_engine_core(EngineConfig(**settings))
    assert isinstance(core.runner.backend, GpuAttentionBackend)
    for layer in core.runner.backend.kv_caches:  # poison: a read of an unwritten slot shows as NaN
        for tensor in (layer.key, layer.value, layer.index_key):
            if tensor is not None:
                tensor.fill_(float("nan"))
    return core


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(380) for _ in range(length)]


def _generate(core, prompts: dict[str, list[int]], stagger: int = 0, new_tokens: int = NEW_TOKENS) -> dict:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
    results = offline.generate(core, requests, stagger_steps=stagger, check_invariants=True)
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_usable_blocks
    return {rid: r.token_ids for rid, r in results.items()}


PROMPTS = {f"r{i}": _prompt(i, n) for i, n in enumerate((300, 17, 129, 64, 250))}


@pytest.fixture(scope="module")
def whole_prefill():
    return _generate(_core(), PROMPTS)


def test_engine_matches_transformers_on_the_gpu(whole_prefill):
    oracle = MiniMaxM3SparseForConditionalGeneration.from_pretrained(ensure_tiny_checkpoint(), dtype=torch.float32)
    oracle = oracle.to("cuda").eval()
    for rid in ("r0", "r2"):
        prompt = torch.tensor([PROMPTS[rid]], device="cuda")
        with torch.inference_mode():
            out = oracle.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)  # fmt: skip
        assert whole_prefill[rid] == out[0, prompt.shape[1] :].tolist(), rid


@pytest.mark.parametrize("budget", [16, 100])
def test_chunked_prefill_gives_the_same_tokens(whole_prefill, budget):
    assert _generate(_core(max_num_batched_tokens=budget), PROMPTS) == whole_prefill


def test_batch_composition_and_arrival_order_give_the_same_tokens(whole_prefill):
    alone = {rid: _generate(_core(), {rid: prompt})[rid] for rid, prompt in PROMPTS.items()}
    assert alone == whole_prefill
    assert _generate(_core(max_num_batched_tokens=96), PROMPTS, stagger=5) == whole_prefill


def test_a_prefix_hit_gives_the_same_tokens_as_a_miss():
    shared = _prompt(50, 200)
    later = [*shared, *_prompt(51, 30)]
    miss = _generate(_core(), {"later": later})["later"]
    core = _core()
    _generate(core, {"first": [*shared, 1, 2, 3]})
    assert _generate(core, {"later": later})["later"] == miss
    assert core.scheduler.kv.prefix_hit_tokens == 192


def _tight_blocks(core, num_requests: int, tokens_per_request: int) -> int:
    """A pool two blocks short of what the requests need at once (plus the null block): the GPU backend's
    128-token blocks hold far more per block than the CPU tests' small ones, so the count follows the size."""
    block_size = core.scheduler.kv.block_size
    return 1 + num_requests * -(-tokens_per_request // block_size) - 2


def test_preemption_by_recompute_gives_the_same_tokens():
    prompts = {f"p{i}": _prompt(60 + i, 100) for i in range(4)}
    roomy_core = _core()
    roomy = _generate(roomy_core, prompts, new_tokens=60)
    tight = _core(num_kv_blocks=_tight_blocks(roomy_core, len(prompts), 160), max_model_len=200)
    assert _generate(tight, prompts, new_tokens=60) == roomy
    assert tight.scheduler.num_preemptions > 0


def _dense_mlp_core(cuda_graphs: bool, async_scheduling: bool, max_num_seqs: int = 8, max_model_len: int = 2048):
    """The tiny model's shape with dense MLPs everywhere and random weights: its decode forward never
    synchronizes with the host (the MoE's per-expert split does), so the attention backend is what decides
    whether decode can be captured."""
    checkpoint = ensure_tiny_checkpoint()
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["text_config"]["mlp_layer_types"] = ["dense"] * raw["text_config"]["num_hidden_layers"]
    m3 = parse_config(raw)
    model = M3ForServing(m3, torch.float32, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1, generator=generator)
    config = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                          async_scheduling=async_scheduling)  # fmt: skip
    return assemble_engine_core(config, model.eval(), m3, model_path="dense-tiny", device=torch.device("cuda"),
                                dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_graph_decode_matches_eager_decode(async_scheduling):
    eager = _generate(_dense_mlp_core(cuda_graphs=False, async_scheduling=False), PROMPTS)
    core = _dense_mlp_core(cuda_graphs=True, async_scheduling=async_scheduling)
    assert core.runner.decode_graphs is not None and core.runner.decode_graphs.captured, "nothing was captured"
    graphs = _generate(core, PROMPTS)
    assert core.runner.num_graph_steps >= NEW_TOKENS - 2  # the plain decode steps replayed graphs
    assert graphs == eager


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_an_eager_decode_step_after_graph_capture_compiles_nothing(max_num_seqs):
    """Decode steps that miss the graphs (a mixed batch, graphs switched off) must reuse the captured kernels' variants:
    Triton compiles one per pointer alignment, and a compile mid-serving stalls every request for seconds.  Batch
    limits 1 and 3 put the graphs' positions and page table at odd offsets of their buffers unless padded.  The
    request nearly fills the context limit, so its eager page tables are about as wide as the graphs' (the scan's
    split count, a constexpr, follows the width)."""
    core = _dense_mlp_core(cuda_graphs=True, async_scheduling=False, max_num_seqs=max_num_seqs, max_model_len=256)
    length = 256 - NEW_TOKENS - 12
    _generate(core, {"graphs": _prompt(0, length)})
    assert core.runner.num_graph_steps >= NEW_TOKENS - 2
    before = kernel_compiles.snapshot()
    core.runner.decode_graphs = None
    _generate(core, {"eager": _prompt(1, length)})  # another prompt of that length: no prefix hit, same prefill
    assert core.runner.num_eager_steps >= NEW_TOKENS
    assert kernel_compiles.snapshot().count == before.count


def test_async_scheduling_gives_the_same_tokens(whole_prefill):
    """One step in flight on a real device queue: placeholders filled on the GPU, staging reused safely."""
    assert _generate(_core(async_scheduling=True), PROMPTS, stagger=3) == whole_prefill
    prompts = {f"p{i}": _prompt(60 + i, 100) for i in range(4)}
    roomy_core = _core()
    roomy = _generate(roomy_core, prompts, new_tokens=60)
    tight = _core(num_kv_blocks=_tight_blocks(roomy_core, len(prompts), 160), max_model_len=200,
                  async_scheduling=True)  # fmt: skip
    assert _generate(tight, prompts, new_tokens=60) == roomy
    assert tight.scheduler.num_preemptions > 0
