"""What the engine is asked to do (``EngineConfig``, from the CLI flags), and the checkpoint folder it names.

Nothing here imports torch, so the CLI can check its arguments before paying for that import.
"""

from dataclasses import dataclass, field
from pathlib import Path

from m3stack.engine.distributed.config import ParallelConfig


def model_folder(model: str) -> Path:
    """The checkpoint folder ``--model`` names; "default" is the tiny random-weight model (created on first use)."""
    if model == "default":
        from m3stack.engine.model.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ValueError(f"--model {model!r} is not a folder (expected an HF-layout M3 checkpoint, or 'default')")
    return folder


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # checkpoint folder, or "default" for the tiny random-weight model
    served_model_name: str = ""
    device: str = "cpu"  # cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | bfloat16 | float32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's limit, capped by the KV capacity
    kv_cache_gb: float | None = None  # None: a memory fraction on cuda, 1 GiB on cpu
    gpu_memory_utilization: float = 0.9
    # Memory of one device for the sizing check before loading (assembly.sizing); None: the GPU's (cuda), none (cpu).
    device_memory_gb: float | None = None
    max_queue: int = 1024
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    # Synthetic requests that compile the kernels before the engine serves (runtime.warmup); None: on for cuda.
    warmup: bool | None = None
    # Schedule step N+1 while step N runs on the device; None: on for cuda (on cpu nothing overlaps).
    async_scheduling: bool | None = None
    encoder_cache_embeds: int | None = None  # None: max(max_num_batched_tokens, 16384)
    num_kv_blocks: int | None = None  # exact KV block count (tests, benchmarks); overrides kv_cache_gb
    cpu_threads: int | None = None  # torch intra-op threads; None: torch's default
    attention: str = "auto"  # auto | msa | dense | naive (builder.make_attention_backend)
    # MSA decode: one index-scan program per group of requests holding the same pages (a shared prompt prefix)
    # scores them for the whole group (msa.decode_index.ScanConfig.shared_pages).
    msa_shared_page_scan: bool = False
    # The MSA k-index's storage: auto (as dtype) | fp8_e4m3 (half the decode scan's bytes, a scale per token).
    index_dtype: str = "auto"
    # K and V storage: auto (as dtype) | fp8_e4m3 (half the bytes of bf16, clamped to e4m3's range, scale 1).
    kv_cache_dtype: str = "auto"
    kv_offload_gb: float = 0.0  # pinned host memory for offloaded KV blocks (engine.offload); 0: off
    kv_offload_hot_blocks: int | None = None  # hot-buffer pages per request; None: one decode token's selection
    seed: int = 0
    # Tensor/expert parallelism over several GPUs (and nodes): engine.distributed.
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
