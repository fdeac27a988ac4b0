"""Sizing before starting: the real M3 release figures against hand-checked arithmetic, the torch-free placement
and KV arithmetic against the engine's own sharded model and KV layout, and the engine refusing a deployment
that cannot hold its model before it loads anything.

The real M3 config (../shared/research/sparse_attention.md: 60 layers, the first 3 dense then 57 MoE layers of 128
experts x 3072 rows, 57 MSA layers, everything else transformers' MiniMaxM3VL defaults) gives 854.08 GB of BF16
and 443.65 GB in the MXFP8 layout, the two releases' published sizes (about 854 GB and 444 GB).
"""

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.sizing import engine_sizing
from m3stack.engine.distributed.model import ShardedM3
from m3stack.engine.distributed.sharding import plan_shards
from m3stack.engine.kv_cache.tensors import FP8_INDEX_DTYPE, FP8_KV_DTYPE, KVCacheSpec
from m3stack.engine.model.config import load_config, parse_config
from m3stack.engine.model.loader import scan_checkpoint
from m3stack.engine.model.mxfp8_writer import RELEASE_IGNORED_LAYERS, write_mxfp8_copy
from m3stack.engine.model.quantization import Mxfp8Config
from m3stack.engine.model.sizing import checkpoint_weights, model_shape, release_weights
from m3stack.engine.model.tiny import write_tiny_checkpoint
from m3stack.sizing import (
    GIB,
    KNOWN_CHECKPOINTS,
    M3_SHAPE,
    Deployment,
    SizingError,
    gpu_memory,
    known_checkpoint,
    page_bytes,
    size,
)

M3_CONFIG = {
    "model_type": "minimax_m3_vl",
    "text_config": {
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 57,
        "layer_types": ["full_attention"] * 3 + ["minimax_m3_sparse"] * 57,
    },
}
H200 = 143771 * 2**20  # bytes nvidia-smi reports for the H200 (../shared/gpu/README.md)
USABLE = int(H200 * 0.9)  # --gpu-memory-utilization 0.9
# Per token per GPU at TP >= 4 (one KV head of 128 per GPU): K and V of 60 layers in bf16, index keys of 57.
M3_KV_PER_TOKEN = 60 * 2 * 1 * 128 * 2 + 57 * 128 * 2  # 45,312 bytes
KV_32K = (32768 // 128 + 1) * 128 * M3_KV_PER_TOKEN  # the default context's 256 blocks and the null block
# The step at the defaults (4096 tokens, 64 sequences): 2 GiB allowance, 6 hidden-sized bf16 activations a token,
# top-4 routed pairs (2 x 6144 + 3 x 3072 bf16 values) and the float32 combine, 4 index heads over 256 blocks,
# float32 logits and probabilities of 64 rows.
STEP = (
    2 * GIB
    + 4096 * 6144 * 6 * 2
    + 4096 * 4 * (2 * 6144 + 3 * 3072) * 2
    + 4096 * 6144 * 4
    + 4 * 4096 * 256 * 4
    + 64 * 200064 * 8
)


@pytest.fixture(scope="module")
def m3():
    return parse_config(M3_CONFIG)


def test_the_release_figures_are_the_real_configs(m3) -> None:
    bf16 = release_weights(m3, None, 2)
    mxfp8 = release_weights(m3, Mxfp8Config(RELEASE_IGNORED_LAYERS), 2)
    assert model_shape(m3.text) == M3_SHAPE
    assert [c.weights for c in KNOWN_CHECKPOINTS] == [bf16, mxfp8]
    # Hand-checked: 57 MoE layers of 128 experts x 3 x 6144 x 3072 and a shared expert, 3 dense MLPs of 12288 rows,
    # 60 attention projections (64 + 2 x 4 heads of 128 in, 64 x 128 out; the 57 MSA layers' 4 index-query heads
    # and one index key of 128),
    # a 200064-row LM head, all bf16; embeddings, norms, routers (57 x 128 x 6144) on every GPU.
    experts = 57 * (128 + 1) * 3 * 6144 * 3072
    dense = 3 * 3 * 6144 * 12288
    attention = 60 * 6144 * (64 + 2 * 4 + 64) * 128 + 57 * 6144 * (4 + 1) * 128
    assert bf16.split == 2 * (experts + dense + attention + 200064 * 6144)
    norms = 60 * 2 * 6144 + 60 * 2 * 128 + 57 * 2 * 128 + 6144  # layer norms, q/k norms, index q/k norms, final
    assert bf16.replicated == 2 * (200064 * 6144 + norms + 57 * 128 * (6144 + 1))  # router weight and bias
    # MXFP8: every split linear but the LM head is 1 byte a value plus a 1-byte scale per 32.
    assert mxfp8.split == (experts + dense + attention) * 33 // 32 + 2 * 200064 * 6144
    assert round(bf16.total / 1e9, 2) == 854.08 and round(mxfp8.total / 1e9, 2) == 443.65


def _m3_on(checkpoint: str, gpus: int):
    known = known_checkpoint(f"/models/{checkpoint}")
    assert known is not None
    scratch = GIB if known.mxfp8 else 0
    return known, size(known.weights, known.shape, Deployment(gpus=gpus, gpu_memory_bytes=H200, scratch_bytes=scratch))


def test_bf16_m3_does_not_fit_four_h200s() -> None:
    _, sizing = _m3_on("MiniMax-M3", 4)
    assert sizing.weights == 849_799_544_832 // 4 + 2_549_601_024 + 1_731_134_464  # 201.8 GiB
    assert sizing.weights > USABLE and not sizing.fits and sizing.max_context == 0
    assert "does not fit" in sizing.summary() and "weights 201.8 GiB" in sizing.summary()


def test_mxfp8_m3_fits_four_h200s() -> None:
    _, sizing = _m3_on("MiniMax-M3-MXFP8", 4)
    assert sizing.weights == 439_368_671_232 // 4 + 2_549_601_024 + 1_731_134_464  # 106.3 GiB
    assert sizing.reserve == STEP + GIB  # and the MXFP8 scratch
    assert sizing.kv == KV_32K and sizing.usable == USABLE
    assert sizing.fits and sizing.weights + sizing.reserve + sizing.kv == 120_061_218_560
    # What is left (15.9 GiB) holds 2,948 blocks of 128 after the null block: 377,344 tokens.
    left = USABLE - sizing.weights - sizing.reserve
    assert sizing.max_context == (left // (128 * M3_KV_PER_TOKEN) - 1) * 128 == 377_344


def test_bf16_m3_fits_eight_h200s() -> None:
    _, sizing = _m3_on("MiniMax-M3", 8)
    assert sizing.weights == 849_799_544_832 // 8 + 2_549_601_024 + 1_731_134_464  # 102.9 GiB
    assert sizing.reserve == STEP and sizing.kv == KV_32K  # 4 KV heads over 8 GPUs: one each, replicated
    assert sizing.fits and sizing.weights + sizing.reserve + sizing.kv == 115_370_252_032


def test_a_long_context_needs_what_its_kv_takes() -> None:
    """MXFP8 on 4 H200s holds 377K tokens of bf16 KV; 512K needs an fp8 cache or CPU offload (the index keys of the
    host's blocks stay on the GPUs: 12 GiB a GPU holds 3,449 blocks' K and V, whose index keys take 7.1 GB)."""
    known, _ = _m3_on("MiniMax-M3-MXFP8", 4)
    base = Deployment(gpus=4, gpu_memory_bytes=H200, scratch_bytes=GIB, max_model_len=524288)
    assert not size(known.weights, known.shape, base).fits
    fp8 = Deployment(**{**base.__dict__, "kv_bytes": 1, "fp8_index": True})
    assert size(known.weights, known.shape, fp8).fits
    offload = Deployment(**{**base.__dict__, "cpu_offload_bytes": 48 * GIB})
    assert size(known.weights, known.shape, offload).fits


def test_gpu_products_and_release_names() -> None:
    assert gpu_memory("NVIDIA-H200") == H200 and gpu_memory("NVIDIA B200") == 183359 * 2**20
    assert gpu_memory("NVIDIA-A10G") is None
    assert known_checkpoint("MiniMaxAI/MiniMax-M3-MXFP8").mxfp8  # type: ignore[union-attr]
    assert known_checkpoint("my-model", "/models/minimax-m3/") is KNOWN_CHECKPOINTS[0]
    assert known_checkpoint("/models/MiniMax-M3-AWQ") is None


@pytest.fixture(scope="module")
def wide_mxfp8(tmp_path_factory):
    """The tiny model with 64-row experts (whole 32-input blocks at 2 GPUs), in MXFP8."""
    root = tmp_path_factory.mktemp("sizing")
    wider = {"intermediate_size": 64, "shared_intermediate_size": 64}
    return write_mxfp8_copy(write_tiny_checkpoint(root / "float", wider), root / "mxfp8")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_placement_matches_the_sharded_model(wide_mxfp8, expert_parallel: bool) -> None:
    """The headers' bytes placed by name, against rank 0's parameters of the engine's sharded model in bf16."""
    config = load_config(wide_mxfp8)
    weights = checkpoint_weights(wide_mxfp8, config, 2)
    quantized = scan_checkpoint(wide_mxfp8, config).quantized
    plan = plan_shards(config.text, 2, 0, expert_parallel)
    model = ShardedM3(config, plan, torch.bfloat16, "meta", quantized=quantized)
    rank_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The router's correction bias stays float32 (counted at 2 bytes here), the shared index-key projection is
    # whole on every rank (counted as divided): within 1%.
    assert abs(weights.per_gpu(2) - rank_bytes) <= 0.01 * rank_bytes
    whole = ShardedM3(config, plan_shards(config.text, 1, 0, False), torch.bfloat16, "meta", quantized=quantized)
    single = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert abs(weights.total - single) <= 0.01 * single


@pytest.mark.parametrize(("kv", "index"), [("auto", "auto"), ("fp8_e4m3", "fp8_e4m3")])
@pytest.mark.parametrize("gpus", [1, 4])
def test_kv_pages_as_the_engine_lays_them_out(m3, kv: str, index: str, gpus: int) -> None:
    text = m3.text
    spec = KVCacheSpec(
        num_layers=text.num_layers, num_kv_heads=max(1, text.num_kv_heads // gpus), head_dim=text.head_dim,
        block_size=text.index_block_size, index_head_dim=text.index_head_dim, sparse_layers=text.sparse_layers,
        dtype=torch.bfloat16, index_dtype=FP8_INDEX_DTYPE if index != "auto" else None,
        kv_dtype=FP8_KV_DTYPE if kv != "auto" else None,
    )  # fmt: skip
    deployment = Deployment(gpus=gpus, gpu_memory_bytes=H200, kv_bytes=1 if kv != "auto" else 2,
                            fp8_index=index != "auto")  # fmt: skip
    assert page_bytes(model_shape(text), deployment) == spec.bytes_per_page


def test_the_engine_refuses_a_device_too_small_before_loading(tiny_model_dir) -> None:
    small = EngineConfig(model=str(tiny_model_dir), device="cpu", device_memory_gb=2.0, max_model_len=4096)
    with pytest.raises(SizingError) as refusal:
        build_engine_core(small)
    message = str(refusal.value)
    # The figures: the device, its usable share, weights, activations, KV for the context, the shortfall.
    for figure in ("does not fit --tensor-parallel 1", "per GPU of 1 x 2.0 GiB (0.9 usable = 1.8 GiB)",
                   "weights 0.0 GiB", "activations 2.", "for 4096 tokens", "short"):  # fmt: skip
        assert figure in message, message
    roomy = EngineConfig(model=str(tiny_model_dir), device="cpu", device_memory_gb=8.0, max_model_len=4096)
    assert engine_sizing(roomy, 8 * GIB).fits
    core = build_engine_core(roomy)
    assert core.info.max_model_len == 4096
