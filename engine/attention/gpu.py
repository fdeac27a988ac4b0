"""The GPU ``AttentionBackend``: Triton MSA kernels and FlashInfer paged attention.

Per step, ``begin_step`` plans on the host from host-known lengths (never waiting for the GPU);
per layer, the new keys go into the paged cache (``msa.store``) and then:

* dense layers: FlashInfer paged decode (every request adds one token) or paged prefill (causal,
  HND, page = block), or the Triton split-K kernel of ``msa.paged_attention`` without FlashInfer
  (pure-decode rows sliced by their own length: a CUDA-graph replay gives the eager step's result);
* MSA layers, decode-like steps (at most ``MAX_DECODE_COLUMNS / Hkv`` new tokens per request): the
  decode indexer (``msa.decode_index``) writes each row's selected pages straight into the page
  list the Triton kernel (or FlashInfer) reads (``msa.decode_attention``); in pure-decode steps the
  indexer also stores the new keys.  ``msa.decode_tuning`` holds these choices;
* MSA layers, prefill steps: the prefill indexer and KV-block-major sparse prefill
  (``msa.prefill_index``, ``msa.prefill_attention``).

It runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (FlashInfer absent: the Triton
paths), which is how CI tests it against ``attention.reference``.

With CPU KV offload (``offload``, an ``engine.offload.device.DeviceOffload``) page tables may name host
blocks: decode steps resolve the selected ones to hot-buffer pages between the indexer and the attention,
prefill steps run requests with host blocks on a working set, and a request with host blocks that adds
several tokens sends the step's MSA layers to the prefill path.

With a ``monitor`` (``engine.msa.metrics.MsaMonitor``) the indexer is timed (CUDA events on sampled eager steps, the
wall clock on the CPU): phase ``decode`` for the decode indexer (its scan only where the attention merges the lists),
``prefill`` for the prefill indexer.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from m3stack.engine.attention.flashinfer_dense import FLASHINFER_HEAD_DIMS, FlashInferDense
from m3stack.engine.host_copy import upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import FP8_KV_DTYPE, LayerKVCache
from m3stack.engine.msa.decode_attention import (
    WORKSPACE_BYTES,
    FlashInferSparseDecode,
    flashinfer_available,
    sparse_decode_attention,
)
from m3stack.engine.msa.decode_fused import select_and_attend
from m3stack.engine.msa.decode_index import MAX_DECODE_COLUMNS, NewKeys, decode_index_topk, scan_index_pages
from m3stack.engine.msa.decode_plan import DecodePlanBuffers, SparseDecodePlan, SparseDecodeShape, plan_sparse_decode
from m3stack.engine.msa.decode_tuning import DecodeTuning
from m3stack.engine.msa.launch import use_triton
from m3stack.engine.msa.metrics import MsaMonitor, index_scan
from m3stack.engine.msa.paged_attention import PageRows, decode_slicing, paged_attention
from m3stack.engine.msa.prefill_attention import sparse_prefill
from m3stack.engine.msa.prefill_index import prefill_index_topk
from m3stack.engine.msa.store import store_kv

if TYPE_CHECKING:
    from m3stack.engine.offload.device import DeviceOffload

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """What ``begin_step`` prepared for every layer of the step."""

    dense_rows: PageRows
    dense_flashinfer: FlashInferDense | None
    decode: SparseDecodePlan | None  # None: MSA layers take the prefill path this step
    sparse_flashinfer: FlashInferSparseDecode | None
    slot: "_DecodeSlot | None"  # pure-decode steps: the batch size's fixed buffers


@dataclass
class _DecodeSlot:
    """Everything a pure-decode step of one batch size plans into, at fixed device addresses: CUDA
    graphs captured for that size replay over it (engine.runtime.cuda_graphs)."""

    token_request: torch.Tensor  # arange(R) int32
    plan_buffers: DecodePlanBuffers | None  # None without MSA layers
    dense_flashinfer: FlashInferDense | None
    sparse_flashinfer: FlashInferSparseDecode | None
    captured: bool = False  # a CUDA graph holds its addresses: never evicted


# Batch sizes whose decode buffers are kept (least recently used ones beyond this are dropped,
# unless a CUDA graph was captured over them); the runner captures ~20 sizes.
_MAX_DECODE_SLOTS = 48


class GpuAttentionBackend:
    """``AttentionBackend`` over ``kv_caches`` (one ``LayerKVCache`` per layer) on a CUDA device.

    ``topk_blocks`` / ``local_blocks`` are the model's MSA settings.  ``num_q_heads`` lets
    ``begin_step`` plan everything up front, as CUDA graphs need (without it the plan is made at
    the step's first layer, which must then run eagerly).  ``use_flashinfer`` defaults to "when
    installed and the cache is float16/bfloat16" (dense layers; MSA decode attention follows
    ``decode_tuning.attention``).  Pure-decode steps plan into buffers kept per batch size, and every
    launch size follows the page table's width, so graphs captured per batch size replay over later
    steps.
    """

    @property
    def supports_cuda_graphs(self) -> bool:
        """Capturable when ``begin_step`` plans everything (``num_q_heads`` given)."""
        return self.num_q_heads is not None

    def __init__(
        self,
        kv_caches: list[LayerKVCache],
        *,
        topk_blocks: int,
        local_blocks: int,
        num_q_heads: int | None = None,
        use_flashinfer: bool | None = None,
        decode_tuning: DecodeTuning | None = None,
        offload: "DeviceOffload | None" = None,
        monitor: MsaMonitor | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("GpuAttentionBackend needs at least one layer's KV cache")
        first = kv_caches[0]
        self.device = first.key.device
        if not use_triton(first.key):
            raise ValueError(f"GpuAttentionBackend runs on CUDA (or CPU under TRITON_INTERPRET=1), not {self.device}")
        sparse_layer = next((c for c in kv_caches if c.index_key is not None), None)
        self.kv_caches = kv_caches
        self.topk_blocks = topk_blocks
        self.local_blocks = local_blocks
        self.num_q_heads = num_q_heads
        self.decode_tuning = decode_tuning or DecodeTuning()
        self.offload = offload
        self.monitor = monitor  # times the indexer (engine.msa.metrics)
        self._index_head_dim = sparse_layer.index_key.shape[2] if sparse_layer is not None else None
        # FlashInfer attends in half precision at a few head dims only; other caches take the Triton paths.
        half = first.key.dtype in (torch.float16, torch.bfloat16)
        if use_flashinfer and not half:
            raise ValueError(f"FlashInfer needs a float16/bfloat16 KV cache, not {first.key.dtype}")
        head_dim_supported = first.key.shape[3] in FLASHINFER_HEAD_DIMS
        if use_flashinfer and not head_dim_supported:
            raise ValueError(f"FlashInfer supports head dims {FLASHINFER_HEAD_DIMS}, not {first.key.shape[3]}")
        if use_flashinfer is None:
            use_flashinfer = flashinfer_available(self.device) and half and head_dim_supported
        self.use_flashinfer = use_flashinfer
        self._workspace: torch.Tensor | None = None
        self._fi_dense: FlashInferDense | None = None
        self._fi_sparse: FlashInferSparseDecode | None = None
        self._sparse_decode_flashinfer = self.use_flashinfer and self.decode_tuning.attention == "flashinfer"
        if self.use_flashinfer:
            # One split-K workspace for every wrapper: their runs follow each other on one stream.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self._fi_dense = FlashInferDense(self._workspace)
            if self._sparse_decode_flashinfer:
                self._fi_sparse = FlashInferSparseDecode(self.device, self._workspace)
        self._decode_slots: OrderedDict[int, _DecodeSlot] = OrderedDict()
        self._metadata: AttentionMetadata | None = None
        self._step: _StepPlan | None = None
        logger.info("GPU attention backend on %s (FlashInfer: %s)", self.device, self.use_flashinfer)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        block_size = self.kv_caches[0].key.shape[2]
        if metadata.block_size != block_size:
            raise ValueError(f"metadata block_size {metadata.block_size} != cache page size {block_size}")
        # numpy, not torch: a handful of torch CPU ops on tiny tensors costs tens of microseconds a step.
        query_lens = np.diff(metadata.query_start_loc_cpu.numpy())
        over = np.flatnonzero(query_lens > metadata.seq_lens_cpu.numpy())
        if len(over):
            raise ValueError(f"requests {over.tolist()} add more tokens than their context")
        self._metadata = metadata
        self._step = None
        if self.num_q_heads is not None:
            self._step = self._plan(metadata, self.num_q_heads)

    def _sparse_shape(self, num_q_heads: int) -> SparseDecodeShape | None:
        if self._index_head_dim is None:
            return None
        _, num_kv_heads, block_size, head_dim = self.kv_caches[0].key.shape
        return SparseDecodeShape(
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, index_head_dim=self._index_head_dim,
            block_size=block_size, topk=self.topk_blocks, local_blocks=self.local_blocks,
        )  # fmt: skip

    def _decode_slot(self, num_requests: int, shape: SparseDecodeShape | None) -> _DecodeSlot:
        slot = self._decode_slots.get(num_requests)
        if slot is None:
            buffers = DecodePlanBuffers(num_requests, shape, self.device) if shape is not None else None
            slot = _DecodeSlot(
                token_request=torch.arange(num_requests, dtype=torch.int32, device=self.device),
                plan_buffers=buffers,
                dense_flashinfer=FlashInferDense(self._workspace, num_requests) if self.use_flashinfer else None,
                sparse_flashinfer=(FlashInferSparseDecode(self.device, self._workspace, buffers)
                                   if self._sparse_decode_flashinfer and buffers is not None else None),
            )  # fmt: skip
            self._decode_slots[num_requests] = slot
            # Eager decode of ever new batch sizes must not grow without bound (each slot holds
            # FlashInfer wrappers with their own workspaces).
            evictable = [size for size, kept in self._decode_slots.items() if not kept.captured]
            for size in evictable[: max(0, len(self._decode_slots) - _MAX_DECODE_SLOTS)]:
                del self._decode_slots[size]
        self._decode_slots.move_to_end(num_requests)
        return slot

    def _plan(self, metadata: AttentionMetadata, num_q_heads: int) -> _StepPlan:
        key_cache = self.kv_caches[0].key
        num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
        shape = self._sparse_shape(num_q_heads)
        slot = None
        if metadata.is_pure_decode:
            slot = self._decode_slot(metadata.num_requests, shape)
            token_request, buffers = slot.token_request, slot.plan_buffers
            dense_fi, sparse_fi = slot.dense_flashinfer, slot.sparse_flashinfer
        else:
            lens = metadata.query_lens_cpu.to(torch.int64)
            request = torch.repeat_interleave(torch.arange(metadata.num_requests, dtype=torch.int32), lens)
            token_request, buffers = upload(request, self.device), None
            dense_fi, sparse_fi = self._fi_dense, self._fi_sparse
        # Launch sizes follow the page table's width, fixed across the steps a CUDA graph replays.
        dense_rows = PageRows(token_request=token_request, positions=metadata.positions,
                              page_table=metadata.page_table, row_indptr=None, page_ids=None, last_len=None,
                              max_pages=metadata.page_table.shape[1])  # fmt: skip
        if dense_fi is not None and metadata.num_tokens:
            dense_fi.plan(metadata, num_q_heads, key_cache)
        decode = None
        offload_prefill = self.offload is not None and self.offload.needs_prefill_path()
        max_query_len = 1 if slot is not None else metadata.max_query_len
        if shape is not None and max_query_len * num_kv_heads <= MAX_DECODE_COLUMNS and not offload_prefill:
            programs_per_sm = self.decode_tuning.planned_programs_per_sm
            decode = plan_sparse_decode(metadata, shape, self.device, buffers=buffers,
                                        scan_programs_per_sm=programs_per_sm)  # fmt: skip
            if sparse_fi is not None:
                sparse_fi.plan(decode, key_cache.dtype, head_dim**-0.5)
        return _StepPlan(dense_rows, dense_fi, decode, sparse_fi, slot)

    def _begin_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None,
                     store: bool = True) -> tuple[AttentionMetadata, _StepPlan, LayerKVCache]:  # fmt: skip
        metadata = self._metadata
        if metadata is None:
            raise RuntimeError("begin_step(metadata) must be called before the first layer")
        if self.kv_caches[layer].key.dtype not in (q.dtype, FP8_KV_DTYPE):
            raise ValueError(f"q is {q.dtype} but layer {layer}'s cache holds {self.kv_caches[layer].key.dtype}")
        if self._step is None:
            self._step = self._plan(metadata, q.shape[1])
        if self._step.slot is not None and q.is_cuda and torch.cuda.is_current_stream_capturing():
            self._step.slot.captured = True
        cache = self.kv_caches[layer]
        if store:
            store_kv(cache, metadata.slot_mapping, k, v, index_k)
        return metadata, self._step, cache

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, step, cache = self._begin_layer(layer, q, k, v, None)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if step.dense_flashinfer is not None:
            return step.dense_flashinfer.run(q, cache.key, cache.value)
        if step.slot is not None:  # pure decode: each row sliced by its own length, so a graph replay = eager
            pages_per_split, row_slices = decode_slicing(cache.key.shape[2])
            return paged_attention(q, cache.key, cache.value, step.dense_rows, q.shape[-1] ** -0.5,
                                   pages_per_split=pages_per_split, row_slices=row_slices)  # fmt: skip
        return paged_attention(q, cache.key, cache.value, step.dense_rows, q.shape[-1] ** -0.5)

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        if self.kv_caches[layer].index_key is None:
            raise ValueError(f"layer {layer} has no index-key cache: the KV cache spec says it is not an MSA layer")
        tuning = self.decode_tuning
        metadata, step, cache = self._begin_layer(layer, q, k, v, index_k, store=False)
        # Pure decode: the new keys land in the local block, which the scan never reads, so it stores them.
        scan_stores = step.decode is not None and metadata.is_pure_decode and tuning.fused_store
        if not scan_stores:
            store_kv(cache, metadata.slot_mapping, k, v, index_k)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        if step.decode is not None:
            new_keys = NewKeys(cache, metadata.slot_mapping, k, v, index_k) if scan_stores else None
            fp8_index = cache.index_key.dtype == torch.float8_e4m3fn
            # Offload resolves the selected pages and FlashInfer reads them between merge and attention.
            selects = (tuning.selects_in_attention(metadata.num_requests) and self.offload is None
                       and step.sparse_flashinfer is None)  # fmt: skip
            scan = tuning.scan_for(metadata.num_requests, fp8_index, unmerged=selects)
            if selects:  # the attention merges the scan's lists: the scan alone is timed
                with index_scan(self.monitor, "decode", q.shape[0]):
                    unmerged = scan_index_pages(index_q, cache.index_key, metadata, step.decode, scan, new_keys,
                                                cache.index_key_scale)  # fmt: skip
                return select_and_attend(q, cache.key, cache.value, unmerged, metadata, step.decode, scale,
                                         tuning.triton_attention)  # fmt: skip
            with index_scan(self.monitor, "decode", q.shape[0]):
                decode_index_topk(index_q, cache.index_key, metadata, step.decode, scan, new_keys,
                                  cache.index_key_scale)  # fmt: skip
            if self.offload is not None:
                self.offload.resolve_decode(layer, step.decode, metadata)
            return sparse_decode_attention(q, cache.key, cache.value, step.decode, metadata.positions,
                                           metadata.page_table, scale, step.sparse_flashinfer,
                                           triton_config=tuning.triton_attention)  # fmt: skip
        with index_scan(self.monitor, "prefill", q.shape[0]):
            selection = prefill_index_topk(index_q, cache.index_key, metadata, self.topk_blocks, self.local_blocks,
                                           index_key_scale=cache.index_key_scale)  # fmt: skip
        if self.offload is not None:
            return self.offload.sparse_prefill(layer, q, selection, metadata, scale)
        return sparse_prefill(q, cache.key, cache.value, selection, metadata, scale)
