"""FlashInfer paged attention for the dense (``full_attention``) layers: HND cache, page = block size.

Pure-decode steps use ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores: M3's group of 16 needs
them), other steps the causal ``BatchPrefillWithPagedKVCacheWrapper``.  ``plan()`` runs on the host
from host-known lengths; the page lists are gathered from the device page table without a sync.
With ``graph_requests``, the decode wrapper runs in FlashInfer's CUDA-graph mode over buffers of
fixed addresses (one instance per captured batch size), and only pure decode of exactly that many
requests may be planned.
"""

import numpy as np
import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata

# Head dims FlashInfer's SM90 prefill kernels are instantiated for (a static_assert in prefill_sm90.cuh);
# other sizes (the tiny model's 32) take the Triton paths.
FLASHINFER_HEAD_DIMS = (64, 128, 256)

# First page-list capacity of a CUDA-graph decode wrapper (grown by doubling when a wider table comes).
_MIN_GRAPH_PAGES = 1024


def dense_page_lists(metadata: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's pages concatenated: ``indptr`` ``[R + 1]`` (host), ``indices`` (device) and
    ``last_page_len`` ``[R]`` (host), all int32.

    Built with numpy; the page ids are gathered from the device page table by flat index, which goes up
    from pinned memory (a copy from pageable memory may wait for the step in flight)."""
    seq_lens = metadata.seq_lens_cpu.numpy().astype(np.int64)
    pages = (seq_lens + block_size - 1) // block_size
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    last_page_len = ((seq_lens - 1) % block_size + 1).astype(np.int32)
    page_table = metadata.page_table
    # Page i of request r sits at r * width + i of the flattened table.
    row_offsets = np.arange(len(seq_lens), dtype=np.int64) * page_table.shape[1] - indptr[:-1]
    flat = torch.from_numpy(np.arange(int(indptr[-1]), dtype=np.int64) + np.repeat(row_offsets, pages))
    if page_table.is_cuda:
        flat = flat.pin_memory()
    indices = page_table.reshape(-1)[flat.to(page_table.device, non_blocking=True)]
    return torch.from_numpy(indptr), indices, torch.from_numpy(last_page_len)


class FlashInferDense:
    def __init__(self, workspace: torch.Tensor, graph_requests: int | None = None) -> None:
        import flashinfer  # lazily: absent on CPU hosts and in CI

        self._flashinfer = flashinfer
        self._workspace = workspace
        self._graph_requests = graph_requests
        self._capacity = 0
        self._prefill = None
        if graph_requests is None:
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True)
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        else:
            self._grow(_MIN_GRAPH_PAGES)
        self._active = self._decode

    def _grow(self, pages: int) -> None:
        """(Re)create the CUDA-graph decode wrapper with room for ``pages`` page ids."""
        requests = self._graph_requests
        device = self._workspace.device
        self._capacity = max(pages, 2 * self._capacity)
        self._graph_buffers = (
            torch.zeros(requests + 1, dtype=torch.int32, device=device),
            torch.zeros(self._capacity, dtype=torch.int32, device=device),
            torch.ones(requests, dtype=torch.int32, device=device),
        )
        indptr, indices, last_page_len = self._graph_buffers
        self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "HND", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len,
        )  # fmt: skip

    def plan(self, metadata: AttentionMetadata, num_q_heads: int, key_cache: torch.Tensor) -> None:
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        indptr, indices, last_page_len = dense_page_lists(metadata, block_size)
        common = dict(q_data_type=key_cache.dtype, kv_data_type=key_cache.dtype, sm_scale=head_dim**-0.5)
        if self._graph_requests is not None:
            if not metadata.is_pure_decode or metadata.num_requests != self._graph_requests:
                raise ValueError(f"this FlashInferDense serves pure decode of {self._graph_requests} requests only")
            # Room for the widest table of this batch size, so the wrapper a graph captured keeps its buffers.
            width = metadata.num_requests * metadata.page_table.shape[1]
            if width > self._capacity:
                self._grow(width)
        if metadata.is_pure_decode:
            self._active = self._decode
            self._decode.plan(indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_dim, block_size,
                              **common)  # fmt: skip
        else:
            self._active = self._prefill
            self._prefill.plan(metadata.query_start_loc_cpu, indptr, indices, last_page_len, num_q_heads,
                               num_kv_heads, head_dim, block_size, causal=True, **common)  # fmt: skip

    def run(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        return self._active.run(q.contiguous(), (key_cache, value_cache))
