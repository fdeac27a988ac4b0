"""Whether a checkpoint fits one engine's GPUs, with the figures: weights per GPU, activation reserve, the KV cache
that the context needs, and what is left.  Torch-free: the engine checks before it loads (``engine.assembly``),
``m3stack up`` before it starts engines, and the operator for an M3Deployment (which cannot read the checkpoint:
it knows the released M3 checkpoints by name, ``KNOWN_CHECKPOINTS``).

The arithmetic, per GPU of an engine of ``gpus`` GPUs (tensor parallel, with or without expert parallelism: both
give each GPU 1/gpus of the experts' bytes):

* weights: the tensors tensor/expert parallelism splits (attention, MLPs, experts, LM head) / gpus, plus those
  every GPU holds (embeddings, norms, routers), plus the vision tower and projector on the first GPU, which is the
  one counted (the fullest).  MXFP8 weights count 1 byte a value plus their scales; float ones the serving dtype.
* activation reserve: a fixed allowance (CUDA context, library workspaces, graph pools, allocator slack), one full
  step's buffers (``max_num_batched_tokens`` tokens through attention and the MoE, the index scores of a prefill
  chunk over the whole context, logits of ``max_num_seqs`` rows) and the MXFP8 large-step scratch.  The engine
  measures the real step after loading; this is the estimate before it.
* KV: blocks of ``block_size`` tokens for the context (``max_model_len``; ``DEFAULT_CONTEXT`` where unset), each
  page holding every layer's K and V for this GPU's KV heads plus the MSA index keys, as ``engine.kv_cache``
  lays them out.  With CPU offload the MSA layers' K/V of the host's blocks live in host memory and the device
  keeps their index keys and dense layers' K/V (``engine.offload.layout``).
* fits: weights + reserve + KV <= ``memory_utilization`` of the GPU's memory.
"""

import math
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
# Device memory as nvidia-smi reports it, by product name token (nvidia.com/gpu.product labels: NVIDIA-H200, ...).
# The H200's is this project's measured machine (../shared/gpu/README.md); B200 and H100 are NVIDIA's figures.
GPU_MEMORY = (("H200", 143771 * MIB), ("B200", 183359 * MIB), ("H100", 81559 * MIB))
DEFAULT_MEMORY_UTILIZATION = 0.9  # the engine's --gpu-memory-utilization default
DEFAULT_CONTEXT = 32768  # tokens of context required where max_model_len is left to the engine
FIXED_RESERVE_BYTES = 2 * GIB  # CUDA context, cuBLAS/NCCL workspaces, CUDA graph pools, allocator slack
MXFP8_SCRATCH_BYTES = GIB  # bf16 scratch of an MXFP8 MoE's large steps (engine.model.mxfp8)
MIN_DEVICE_BLOCKS = 4  # device blocks CPU offload keeps (engine.offload.layout)
_INDEX_SCALE_BYTES = 4  # an fp8 k-index's float32 scale per token
_ACTIVATIONS_PER_TOKEN = 6  # hidden-sized tensors a decoder layer keeps alive (residual, norm, q/attn/o outputs)


class SizingError(ValueError):
    """A checkpoint does not fit the GPUs it was given; the message has the figures."""


@dataclass(frozen=True)
class WeightBytes:
    """A checkpoint's weights as an engine holds them, by how tensor/expert parallelism places them."""

    split: int  # divided over the engine's GPUs
    replicated: int  # on every GPU
    leader: int  # on the first GPU only (vision tower, projector)

    @property
    def total(self) -> int:
        return self.split + self.replicated + self.leader

    def per_gpu(self, gpus: int) -> int:
        """Bytes on the first GPU (the fullest)."""
        return self.leader + self.replicated + -(-self.split // gpus)


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the activations of an M3 model depend on."""

    num_layers: int
    sparse_layers: int  # MSA layers: they also cache index keys
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    index_heads: int
    block_size: int
    hidden_size: int
    moe_intermediate_size: int
    experts_per_token: int
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class Deployment:
    """One engine: its GPUs and the settings that size its KV cache and steps."""

    gpus: int
    gpu_memory_bytes: int
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    max_model_len: int | None = None
    activation_bytes: int = 2  # the serving dtype's (bf16)
    kv_bytes: int = 2  # K and V storage: 2 (as bf16), 1 (fp8_e4m3)
    fp8_index: bool = False  # an fp8 k-index with a float32 scale per token
    cpu_offload_bytes: int = 0  # pinned host memory for KV blocks, the engine's in all (each GPU has 1/gpus)
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    scratch_bytes: int = 0  # MXFP8_SCRATCH_BYTES for an MXFP8 checkpoint
    kv_cache_bytes: int | None = None  # a KV cache of this size per GPU (the engine's --kv-cache-gb), not sized


@dataclass(frozen=True)
class Sizing:
    """The figures for one GPU of the engine, and the verdict."""

    deployment: Deployment
    context: int  # tokens of context the KV cache must hold
    weights: int
    reserve: int
    kv: int  # device bytes of the KV cache for ``context``
    usable: int  # memory_utilization x the GPU's memory
    max_context: int  # tokens of context the memory left after weights and reserve holds (0: none)

    @property
    def fits(self) -> bool:
        return self.weights + self.reserve + self.kv <= self.usable

    def summary(self) -> str:
        dep = self.deployment
        needed = self.weights + self.reserve + self.kv
        verdict = "fits" if self.fits else f"does not fit: {_gib(needed - self.usable)} short"
        offload = f", {_gib(dep.cpu_offload_bytes)} CPU KV offload" if dep.cpu_offload_bytes else ""
        return (
            f"per GPU of {dep.gpus} x {_gib(dep.gpu_memory_bytes)} ({dep.memory_utilization:g} usable = "
            f"{_gib(self.usable)}): weights {_gib(self.weights)} + activations {_gib(self.reserve)} + KV cache "
            f"{_gib(self.kv)} for {self.context} tokens{offload} = {_gib(needed)}, {verdict}; the memory left after "
            f"weights and activations holds {self.max_context} tokens of context"
        )


def size(weights: WeightBytes, shape: ModelShape, deployment: Deployment) -> Sizing:
    """The figures of ``weights`` on ``deployment``'s GPUs."""
    if deployment.gpus < 1 or deployment.gpu_memory_bytes <= 0:
        raise ValueError(f"a deployment needs GPUs with memory, got {deployment}")
    context = deployment.max_model_len or min(DEFAULT_CONTEXT, shape.max_position_embeddings)
    if deployment.kv_cache_bytes is not None:  # the cache's size is given: the context is what it holds
        context = deployment.max_model_len or max_context(shape, deployment, deployment.kv_cache_bytes)
    usable = int(deployment.gpu_memory_bytes * deployment.memory_utilization)
    per_gpu = weights.per_gpu(deployment.gpus)
    reserve = activation_reserve(shape, deployment, context)
    kv = kv_bytes(shape, deployment, context) if deployment.kv_cache_bytes is None else deployment.kv_cache_bytes
    left = usable - per_gpu - reserve
    return Sizing(deployment, context, per_gpu, reserve, kv, usable, max_context(shape, deployment, left))


def activation_reserve(shape: ModelShape, deployment: Deployment, context: int) -> int:
    """Bytes one full step needs beyond weights and KV, plus the fixed allowance and the MXFP8 scratch."""
    tokens, item = deployment.max_num_batched_tokens, deployment.activation_bytes
    hidden, inter = shape.hidden_size, shape.moe_intermediate_size
    layer = tokens * hidden * _ACTIVATIONS_PER_TOKEN * item
    # Routed pairs: the permuted inputs and outputs (hidden) and the gate|up and SwiGLU outputs (3 x inter), then
    # the float32 combine over the tokens.
    moe = tokens * shape.experts_per_token * (2 * hidden + 3 * inter) * item + tokens * hidden * 4
    index_scores = shape.index_heads * tokens * math.ceil(context / shape.block_size) * 4 if shape.sparse_layers else 0
    logits = deployment.max_num_seqs * shape.vocab_size * 4 * 2  # float32 logits and probabilities
    return FIXED_RESERVE_BYTES + deployment.scratch_bytes + layer + moe + index_scores + logits


def kv_heads_per_gpu(shape: ModelShape, gpus: int) -> int:
    """KV heads each GPU caches: a share, or one (replicated) past num_kv_heads GPUs."""
    return max(1, shape.num_kv_heads // gpus)


def page_bytes(shape: ModelShape, deployment: Deployment) -> int:
    """Device bytes of one KV block on one GPU: every layer's K and V, and the index keys of MSA layers."""
    return shape.num_layers * _kv_page(shape, deployment) + shape.sparse_layers * _index_page(shape, deployment)


def kv_bytes(shape: ModelShape, deployment: Deployment, context: int) -> int:
    """Device bytes one GPU's KV cache needs to hold ``context`` tokens (plus the reserved null block)."""
    blocks = math.ceil(context / shape.block_size) + 1
    host_blocks = _host_blocks(shape, deployment)
    if not host_blocks:
        return blocks * page_bytes(shape, deployment)
    device_blocks = max(MIN_DEVICE_BLOCKS, blocks - host_blocks)
    return host_blocks * _device_part_of_host_block(shape, deployment) + device_blocks * page_bytes(shape, deployment)


def exact_blocks_bytes(shape: ModelShape, deployment: Deployment, device_blocks: int) -> int:
    """Device bytes of a KV cache of exactly ``device_blocks`` usable blocks (and, under CPU offload, the device
    part of the host's blocks)."""
    host = _host_blocks(shape, deployment) * _device_part_of_host_block(shape, deployment)
    return (device_blocks + 1) * page_bytes(shape, deployment) + host


def max_context(shape: ModelShape, deployment: Deployment, kv_budget: int) -> int:
    """Tokens of context ``kv_budget`` device bytes hold (with the host's blocks under offload), up to the
    model's limit."""
    host_blocks = _host_blocks(shape, deployment)
    budget = kv_budget - host_blocks * _device_part_of_host_block(shape, deployment)
    device_blocks = budget // page_bytes(shape, deployment) if budget > 0 else 0
    if host_blocks and device_blocks < MIN_DEVICE_BLOCKS:
        return 0
    blocks = max(0, device_blocks - 1) + host_blocks
    return min(blocks * shape.block_size, shape.max_position_embeddings)


def gpu_memory(product: str) -> int | None:
    """Bytes of memory of a GPU product (``NVIDIA-H200``, ``NVIDIA H200``); None when not in ``GPU_MEMORY``."""
    tokens = set(product.upper().replace(" ", "-").split("-"))
    return next((memory for name, memory in GPU_MEMORY if name in tokens), None)


@dataclass(frozen=True)
class KnownCheckpoint:
    """A released checkpoint's figures, for where only its name is known (the operator)."""

    name: str  # the release's name: a model path's last component or a served model name
    weights: WeightBytes  # served in bf16
    shape: ModelShape
    mxfp8: bool


# MiniMax-M3: 60 layers (3 dense, then 57 MoE layers with 128 experts of 3072 rows, top-4, a shared expert;
# 57 MSA layers), hidden 6144, 64 query and 4 KV heads of 128, vocab 200064, 524288 positions (the public
# descriptions in ../shared/research/sparse_attention.md).  The byte counts are what engine.model.sizing counts
# for that config in the BF16 and the MXFP8 release layouts (tests/engine/model/test_sizing.py recomputes them):
# 854.1 GB and 443.6 GB in all, the releases' published sizes (about 854 GB and 444 GB).
M3_SHAPE = ModelShape(
    num_layers=60, sparse_layers=57, num_kv_heads=4, head_dim=128, index_head_dim=128, index_heads=4, block_size=128,
    hidden_size=6144, moe_intermediate_size=3072, experts_per_token=4, vocab_size=200064,
    max_position_embeddings=524288,
)  # fmt: skip
KNOWN_CHECKPOINTS = (
    KnownCheckpoint("MiniMax-M3", WeightBytes(split=849_799_544_832, replicated=2_549_601_024, leader=1_731_134_464),
                    M3_SHAPE, mxfp8=False),
    KnownCheckpoint("MiniMax-M3-MXFP8", WeightBytes(split=439_368_671_232, replicated=2_549_601_024,
                                                    leader=1_731_134_464), M3_SHAPE, mxfp8=True),
)  # fmt: skip


def known_checkpoint(*names: str) -> KnownCheckpoint | None:
    """The released checkpoint one of ``names`` (a path, a served name, an HF id) ends with, case-insensitively."""
    for name in names:
        last = name.rstrip("/").rsplit("/", 1)[-1].lower()
        for checkpoint in KNOWN_CHECKPOINTS:
            if last == checkpoint.name.lower():
                return checkpoint
    return None


def _kv_page(shape: ModelShape, deployment: Deployment) -> int:
    heads = kv_heads_per_gpu(shape, deployment.gpus)
    return 2 * heads * shape.block_size * shape.head_dim * deployment.kv_bytes


def _index_page(shape: ModelShape, deployment: Deployment) -> int:
    if deployment.fp8_index:
        return shape.block_size * (shape.index_head_dim + _INDEX_SCALE_BYTES)
    return shape.block_size * shape.index_head_dim * deployment.activation_bytes


def _host_blocks(shape: ModelShape, deployment: Deployment) -> int:
    """Blocks each GPU's share of the CPU offload holds (the MSA layers' K and V)."""
    if not deployment.cpu_offload_bytes or not shape.sparse_layers:
        return 0
    per_block = shape.sparse_layers * _kv_page(shape, deployment)
    return deployment.cpu_offload_bytes // deployment.gpus // per_block


def _device_part_of_host_block(shape: ModelShape, deployment: Deployment) -> int:
    dense_layers = shape.num_layers - shape.sparse_layers
    return shape.sparse_layers * _index_page(shape, deployment) + dense_layers * _kv_page(shape, deployment)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"
