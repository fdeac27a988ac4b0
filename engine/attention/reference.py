"""The plain-PyTorch ``AttentionBackend``: any device, float32 math.  CPU serving, CI, and the naive MSA baseline.

Each call stores the step's new K/V (and index keys on MSA layers) into the paged cache with
``engine.msa.store.store_kv`` (its PyTorch path, also when Triton's CPU interpreter is on), then, request by
request, gathers the request's pages back into contiguous ``[S, ...]`` tensors and runs ``engine.msa.reference``
(dense causal GQA, or index block top-k + block-sparse attention).  Simple and exact, and slow by design: it is
the "reference gather + query-major" path the optimized kernels are measured against.  Query rows go through in
slices sized so that one slice's score matrix (query heads x rows x context, float32) stays under
``SCORE_BUDGET_BYTES``, which keeps long prompts within memory on a GPU.

With CPU KV offload (``offload``, an ``engine.offload.device.DeviceOffload``), an MSA layer reads the keys and
values of a request with host blocks through ``offload.reference_kv``: decode tokens through the hot buffer,
longer slices straight from host memory.

With a ``monitor`` (``engine.msa.metrics.MsaMonitor``) each MSA layer's indexer runs (block scores and top-k of
the decode requests, then of the prefill requests) are timed.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import LayerKVCache, dequantize_index_keys
from m3stack.engine.msa.metrics import PHASES, MsaMonitor, Phase, index_scan
from m3stack.engine.msa.reference import dense_causal_attention, index_block_topk, sparse_attention
from m3stack.engine.msa.store import store_kv

if TYPE_CHECKING:
    from m3stack.engine.offload.device import DeviceOffload

SCORE_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class _RequestView:
    """Where one request of the step lives: its rows of the flat batch and its pages."""

    rows: slice
    seq_len: int
    pages: torch.Tensor  # [ceil(seq_len / B)] page ids
    q_positions: torch.Tensor  # [query_len] int64

    @property
    def num_tokens(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def phase(self) -> Phase:
        """How ``engine.msa.metrics`` counts the request's tokens: one new token is decode."""
        return "decode" if self.num_tokens == 1 else "prefill"


class ReferenceAttentionBackend:
    """``AttentionBackend`` over ``kv_caches`` (one ``LayerKVCache`` per layer, from ``allocate_kv_cache``).

    ``topk_blocks`` / ``local_blocks`` are the model's MSA settings (``index_topk_blocks``,
    ``index_local_blocks``); the block size is the cache's page size.
    """

    def __init__(
        self,
        kv_caches: list[LayerKVCache],
        *,
        topk_blocks: int,
        local_blocks: int,
        offload: "DeviceOffload | None" = None,
        monitor: MsaMonitor | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.topk_blocks = topk_blocks
        self.local_blocks = local_blocks
        self.offload = offload
        self.monitor = monitor  # times the indexer (engine.msa.metrics)
        self._metadata: AttentionMetadata | None = None
        self._requests: list[_RequestView] = []

    def begin_step(self, metadata: AttentionMetadata) -> None:
        block_size = metadata.block_size
        if self.kv_caches and self.kv_caches[0].key.shape[2] != block_size:
            raise ValueError(f"metadata block_size {block_size} != cache page size {self.kv_caches[0].key.shape[2]}")
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        positions = metadata.positions.long()
        self._requests = []
        for r, seq_len in enumerate(seq_lens):
            rows = slice(starts[r], starts[r + 1])
            if rows.stop - rows.start > seq_len:
                raise ValueError(f"request {r} adds {rows.stop - rows.start} tokens but its context is {seq_len}")
            num_pages = -(-seq_len // block_size)
            pages = metadata.page_table[r, :num_pages].long()
            self._requests.append(_RequestView(rows, seq_len, pages, positions[rows]))
        self._metadata = metadata

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._store(layer, k, v, None)
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        for request in self._requests:
            keys, values = self._gather_kv(cache, request)
            for rows, local in _row_slices(request, q.shape[1]):
                attended = dense_causal_attention(q[rows], keys, values, request.q_positions[local], scale)
                out[rows] = attended.to(q.dtype)
        return out

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        cache = self._store(layer, k, v, index_k)
        block_size = cache.key.shape[2]
        selections = self._select(cache, index_q, q.shape[1])
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        for row, (request, slices) in enumerate(zip(self._requests, selections, strict=True)):
            offloaded = self.offload is not None and self.offload.has_host_blocks(row)
            keys, values = (None, None) if offloaded else self._gather_kv(cache, request)
            for (rows, local), selected in zip(_row_slices(request, q.shape[1]), slices, strict=True):
                positions = request.q_positions[local]
                if offloaded:
                    keys, values = self.offload.reference_kv(layer, row, request.pages, request.seq_len, selected)
                attended = sparse_attention(q[rows], keys, values, positions, selected, block_size, scale)
                out[rows] = attended.to(q.dtype)
        return out

    def _select(self, cache: LayerKVCache, index_q: torch.Tensor, num_heads: int) -> list[list[torch.Tensor]]:
        """Each request's block selection per row slice (``_row_slices`` of ``num_heads`` query heads).  The indexer
        runs of decode requests (one new token) and of prefill requests are timed apart."""
        block_size = cache.key.shape[2]
        selections: list[list[torch.Tensor]] = [[] for _ in self._requests]
        for phase in PHASES:
            in_phase = [r for r, request in enumerate(self._requests) if request.phase == phase]
            if not in_phase:
                continue
            with index_scan(self.monitor, phase, sum(self._requests[r].num_tokens for r in in_phase)):
                for r in in_phase:
                    request = self._requests[r]
                    scales = (None if cache.index_key_scale is None
                              else cache.index_key_scale[request.pages].flatten(0, 1))  # fmt: skip
                    index_keys = cache.index_key[request.pages].flatten(0, 1)
                    index_keys = dequantize_index_keys(index_keys, scales)[: request.seq_len]
                    selections[r] = [
                        index_block_topk(index_q[rows], index_keys, request.q_positions[local], block_size,
                                         self.topk_blocks, self.local_blocks)
                        for rows, local in _row_slices(request, num_heads)
                    ]  # fmt: skip
        return selections

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None) -> LayerKVCache:
        if self._metadata is None:
            raise RuntimeError("begin_step(metadata) must be called before the first layer")
        cache = self.kv_caches[layer]
        store_kv(cache, self._metadata.slot_mapping, k, v, index_k, torch_only=True)
        return cache

    @staticmethod
    def _gather_kv(cache: LayerKVCache, request: _RequestView) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values ``[S, Hkv, D]`` in position order."""

        def gather(paged: torch.Tensor) -> torch.Tensor:
            # [P, Hkv, B, D] -> [P, B, Hkv, D] -> [P * B, Hkv, D]
            return paged[request.pages].transpose(1, 2).flatten(0, 1)[: request.seq_len]

        return gather(cache.key), gather(cache.value)


def _row_slices(request: _RequestView, num_heads: int) -> list[tuple[slice, slice]]:
    """The request's query rows in slices (flat-batch rows, request-local rows) within the score budget."""
    per_slice = max(1, SCORE_BUDGET_BYTES // (num_heads * request.seq_len * 4))
    start, stop = request.rows.start, request.rows.stop
    return [
        (slice(first, min(first + per_slice, stop)), slice(first - start, min(first + per_slice, stop) - start))
        for first in range(start, stop, per_slice)
    ]
