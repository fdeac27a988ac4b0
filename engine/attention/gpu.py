"""The GPU ``AttentionBackend``: Triton MSA kernels and FlashInfer paged attention.

Per step, ``begin_step`` plans on the host from host-known lengths (never waiting for the GPU);
per layer, the new keys go into the paged cache (``msa.store``) and then:

* dense layers: FlashInfer paged decode (every request adds one token) or paged prefill (causal,
  HND, page = block), or the Triton split-K kernel of ``msa.paged_attention`` without FlashInfer;
* MSA layers, decode-like steps (at most ``MAX_DECODE_COLUMNS / Hkv`` new tokens per request): the
  decode indexer (``msa.decode_index``) writes each row's selected pages straight into the page
  list FlashInfer (or the Triton fallback) reads (``msa.decode_attention``);
* MSA layers, prefill steps: the prefill indexer and KV-block-major sparse prefill
  (``msa.prefill_index``, ``msa.prefill_attention``).

It runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (FlashInfer absent: the Triton
paths), which is how CI tests it against ``attention.reference``.
"""

import logging
from dataclasses import dataclass

import torch

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import LayerKVCache
from m3stack.engine.msa.decode_attention import (
    WORKSPACE_BYTES,
    FlashInferSparseDecode,
    flashinfer_available,
    sparse_decode_attention,
)
from m3stack.engine.msa.decode_index import MAX_DECODE_COLUMNS, ScanConfig, decode_index_topk
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape, plan_sparse_decode
from m3stack.engine.msa.launch import use_triton
from m3stack.engine.msa.paged_attention import PageRows, paged_attention
from m3stack.engine.msa.prefill_attention import sparse_prefill
from m3stack.engine.msa.prefill_index import prefill_index_topk
from m3stack.engine.msa.store import store_kv

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """What ``begin_step`` prepared for every layer of the step."""

    dense_rows: PageRows
    decode: SparseDecodePlan | None  # None: MSA layers take the prefill path this step


class _FlashInferDense:
    """FlashInfer paged attention for the dense layers: decode or causal prefill, HND, page = block."""

    def __init__(self, workspace: torch.Tensor) -> None:
        import flashinfer  # lazily: absent on CPU hosts and in CI

        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._active = self._decode

    def plan(self, metadata: AttentionMetadata, num_q_heads: int, cache: LayerKVCache) -> None:
        _, num_kv_heads, block_size, head_dim = cache.key.shape
        seq_lens = metadata.seq_lens_cpu.to(torch.int64)
        pages = (seq_lens + block_size - 1) // block_size
        indptr = torch.zeros(metadata.num_requests + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=indptr[1:])
        last_page_len = ((seq_lens - 1) % block_size + 1).to(torch.int32)
        # Every request's pages, concatenated: gathered on the device from host-known counts.
        request = torch.repeat_interleave(torch.arange(metadata.num_requests), pages)
        local = torch.arange(int(indptr[-1])) - indptr[:-1].to(torch.int64)[request]
        device = metadata.page_table.device
        indices = metadata.page_table[request.to(device), local.to(device)]
        common = dict(q_data_type=cache.key.dtype, kv_data_type=cache.key.dtype, sm_scale=head_dim**-0.5)
        if metadata.is_pure_decode:
            self._active = self._decode
            self._decode.plan(indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_dim, block_size,
                              **common)  # fmt: skip
        else:
            self._active = self._prefill
            self._prefill.plan(metadata.query_start_loc_cpu, indptr, indices, last_page_len, num_q_heads,
                               num_kv_heads, head_dim, block_size, causal=True, **common)  # fmt: skip

    def run(self, q: torch.Tensor, cache: LayerKVCache) -> torch.Tensor:
        return self._active.run(q.contiguous(), (cache.key, cache.value))


class GpuAttentionBackend:
    """``AttentionBackend`` over ``kv_caches`` (one ``LayerKVCache`` per layer) on a CUDA device.

    ``topk_blocks`` / ``local_blocks`` are the model's MSA settings.  ``num_q_heads`` lets
    ``begin_step`` plan everything up front (needed to capture the layers in a CUDA graph); without
    it the plan is made at the step's first layer.  ``use_flashinfer`` defaults to "when installed".
    """

    def __init__(
        self,
        kv_caches: list[LayerKVCache],
        *,
        topk_blocks: int,
        local_blocks: int,
        num_q_heads: int | None = None,
        use_flashinfer: bool | None = None,
        scan_config: ScanConfig | None = None,
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
        self.scan_config = scan_config or ScanConfig()
        self._index_head_dim = sparse_layer.index_key.shape[2] if sparse_layer is not None else None
        self.use_flashinfer = flashinfer_available(self.device) if use_flashinfer is None else use_flashinfer
        self._fi_dense: _FlashInferDense | None = None
        self._fi_sparse: FlashInferSparseDecode | None = None
        if self.use_flashinfer:
            # One split-K workspace for every wrapper: their runs follow each other on one stream.
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self._fi_dense = _FlashInferDense(workspace)
            self._fi_sparse = FlashInferSparseDecode(self.device, workspace)
        self._metadata: AttentionMetadata | None = None
        self._step: _StepPlan | None = None
        logger.info("GPU attention backend on %s (FlashInfer: %s)", self.device, self.use_flashinfer)

    def begin_step(self, metadata: AttentionMetadata) -> None:
        block_size = self.kv_caches[0].key.shape[2]
        if metadata.block_size != block_size:
            raise ValueError(f"metadata block_size {metadata.block_size} != cache page size {block_size}")
        over = metadata.query_lens_cpu > metadata.seq_lens_cpu
        if bool(over.any()):
            raise ValueError(f"requests {over.nonzero().flatten().tolist()} add more tokens than their context")
        self._metadata = metadata
        self._step = None
        if self.num_q_heads is not None:
            self._step = self._plan(metadata, self.num_q_heads)

    def _plan(self, metadata: AttentionMetadata, num_q_heads: int) -> _StepPlan:
        cache = self.kv_caches[0]
        _, num_kv_heads, block_size, head_dim = cache.key.shape
        request = torch.repeat_interleave(torch.arange(metadata.num_requests), metadata.query_lens_cpu.to(torch.int64))
        dense_rows = PageRows(
            token_request=request.to(torch.int32).to(self.device, non_blocking=True),
            positions=metadata.positions,
            page_table=metadata.page_table,
            row_indptr=None,
            page_ids=None,
            last_len=None,
            max_pages=-(-metadata.max_seq_len // block_size),
        )
        if self._fi_dense is not None and metadata.num_tokens:
            self._fi_dense.plan(metadata, num_q_heads, cache)
        decode = None
        if self._index_head_dim is not None and metadata.max_query_len * num_kv_heads <= MAX_DECODE_COLUMNS:
            shape = SparseDecodeShape(
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                index_head_dim=self._index_head_dim, block_size=block_size, topk=self.topk_blocks,
                local_blocks=self.local_blocks,
            )  # fmt: skip
            decode = plan_sparse_decode(metadata, shape, self.device)
            if self._fi_sparse is not None:
                self._fi_sparse.plan(decode, cache.key.dtype, head_dim**-0.5)
        return _StepPlan(dense_rows=dense_rows, decode=decode)

    def _begin_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     index_k: torch.Tensor | None) -> tuple[AttentionMetadata, _StepPlan, LayerKVCache]:  # fmt: skip
        metadata = self._metadata
        if metadata is None:
            raise RuntimeError("begin_step(metadata) must be called before the first layer")
        if q.dtype != self.kv_caches[layer].key.dtype:
            raise ValueError(f"q is {q.dtype} but layer {layer}'s cache holds {self.kv_caches[layer].key.dtype}")
        if self._step is None:
            self._step = self._plan(metadata, q.shape[1])
        cache = self.kv_caches[layer]
        store_kv(cache, metadata.slot_mapping, k, v, index_k)
        return metadata, self._step, cache

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, step, cache = self._begin_layer(layer, q, k, v, None)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if self._fi_dense is not None:
            return self._fi_dense.run(q, cache)
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
        metadata, step, cache = self._begin_layer(layer, q, k, v, index_k)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        if step.decode is not None:
            decode_index_topk(index_q, cache.index_key, metadata, step.decode, self.scan_config)
            return sparse_decode_attention(
                q, cache.key, cache.value, step.decode, metadata.positions, metadata.page_table, scale, self._fi_sparse
            )
        selection = prefill_index_topk(index_q, cache.index_key, metadata, self.topk_blocks, self.local_blocks)
        return sparse_prefill(q, cache.key, cache.value, selection, metadata, scale)
