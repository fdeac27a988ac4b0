"""What an ``EngineConfig`` chooses, the same on one rank or many: device, dtype, KV cache layout, attention backend."""

import logging
from dataclasses import replace

import torch

from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.attention.dense_only import DenseOnlyAttention, dense_kv_spec
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.tensors import INDEX_DTYPES, KV_CACHE_DTYPES, KVCacheSpec, LayerKVCache
from m3stack.engine.model.config import M3Config
from m3stack.engine.msa.launch import triton_interpreted
from m3stack.engine.msa.metrics import MsaMonitor
from m3stack.engine.offload.device import DeviceOffload

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 1.0
# --attention: the optimized MSA engine, every layer dense on the same backend, the plain-PyTorch reference.
ATTENTION_MODES = ("auto", "msa", "dense", "naive")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def kv_cache_spec(config: EngineConfig, model_spec: KVCacheSpec) -> KVCacheSpec:
    """The cache layout of a model (``model_spec``: its ``kv_cache_spec(dtype)``) as ``config`` stores it: the
    k-index and K/V dtypes asked for, and no index keys with ``--attention dense``."""
    spec = replace(
        model_spec, index_dtype=INDEX_DTYPES[config.index_dtype], kv_dtype=KV_CACHE_DTYPES[config.kv_cache_dtype]
    )
    return dense_kv_spec(spec) if config.attention == "dense" else spec


def make_attention_backend(
    kv_caches: list[LayerKVCache],
    config: M3Config,
    device: torch.device,
    *,
    mode: str = "auto",
    offload: DeviceOffload | None = None,
    shared_page_scan: bool = False,
    monitor: MsaMonitor | None = None,
) -> AttentionBackend:
    """The one place that picks the attention implementation (``--attention``, see ``ATTENTION_MODES``).

    ``msa`` is the GPU backend (Triton MSA kernels, FlashInfer): on cuda, or on cpu under
    ``TRITON_INTERPRET=1`` (tests).  ``dense`` runs every layer through the dense path of the backend
    the device gets (the cache then has no index keys: ``dense_kv_spec``).  ``naive`` is the
    plain-PyTorch reference backend on any device.  ``auto``: ``msa`` on cuda, ``naive`` on cpu.
    ``shared_page_scan`` has the GPU backend's decode indexer scan pages that several requests share once for them
    (``EngineConfig.msa_shared_page_scan``).  ``monitor`` times the MSA indexer (``engine.msa.metrics``).
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose from {', '.join(ATTENTION_MODES)}")
    text = config.text
    selection = {"topk_blocks": text.index_topk_blocks, "local_blocks": text.index_local_blocks, "offload": offload,
                 "monitor": monitor}  # fmt: skip
    kernels = device.type == "cuda" if mode in ("auto", "dense") else mode == "msa"
    if mode == "msa" and not (device.type == "cuda" or triton_interpreted()):
        raise ValueError("--attention msa runs the Triton/FlashInfer kernels: it needs --device cuda")
    backend: AttentionBackend | None = None
    if kernels:
        try:
            from m3stack.engine.attention.gpu import GpuAttentionBackend
            from m3stack.engine.msa.decode_index import ScanConfig
            from m3stack.engine.msa.decode_tuning import DecodeTuning
        except ImportError as exc:
            if mode == "msa":
                raise
            logger.warning("the CUDA attention backend is unavailable (%s); using the reference backend", exc)
        else:
            # num_q_heads lets begin_step plan every layer up front, which CUDA-graph capture needs.
            tuning = DecodeTuning(scan=ScanConfig(shared_pages=True)) if shared_page_scan else None
            backend = GpuAttentionBackend(kv_caches, num_q_heads=text.num_heads, decode_tuning=tuning, **selection)
    if backend is None:
        backend = ReferenceAttentionBackend(kv_caches, **selection)
    return DenseOnlyAttention(backend) if mode == "dense" else backend
