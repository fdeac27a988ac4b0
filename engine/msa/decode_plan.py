"""Host-side plan of one MSA decode step, shared by every sparse layer of the step.

A decode step holds R requests with a few new tokens each (1 for plain decode, more for MTP or a
short chunk).  Everything here follows from host-known lengths (``query_start_loc_cpu``,
``seq_lens_cpu``), so planning never waits for the GPU and the kernels' grids are fixed before
the first layer runs; only the selected page ids are produced on the device, by the index kernel.

Rows of the sparse attention are ``r = t * Hkv + h`` (token, KV head): the "flattened" paged
decode of design/msa.md.  Row ``r`` attends ``min(topk, q + 1)`` pages (``q`` = the token's block),
the token's own block last with ``last_page_len = position % B + 1`` keys; every other page is
full.  Page ids are virtual: ``page * Hkv + h`` addresses the ``[B, D]`` tile of KV head ``h`` in
the HND cache viewed as ``[num_pages * Hkv, 1, B, D]``.
"""

from dataclasses import dataclass

import torch

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.msa.launch import multiprocessors

# Index-scan programs per SM: the scan keeps ~70 KiB of shared memory, so three are resident per H200
# SM; one full wave of them streams the k-index with no tail.
_SCAN_PROGRAMS_PER_SM = 3
# Fewest index pages one scan program streams, so short contexts do not launch empty programs.
_MIN_BLOCKS_PER_SPLIT = 8
# Most splits of one request's index scan: the merge reads ``splits x 16`` candidates per row.
MAX_SCAN_SPLITS = 512


@dataclass(frozen=True)
class SparseDecodeShape:
    """The model's MSA constants (config ``index_*`` fields and attention heads)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    block_size: int
    topk: int
    local_blocks: int

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if not 1 <= self.local_blocks <= self.topk:
            raise ValueError(f"need 1 <= local_blocks <= topk, got {self.local_blocks}, {self.topk}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")


@dataclass
class SparseDecodePlan:
    """Device tensors and launch sizes of one decode step (see the module docstring)."""

    shape: SparseDecodeShape
    num_requests: int
    num_tokens: int
    max_query_len: int
    token_request: torch.Tensor  # [T] int32, request of each token
    row_indptr: torch.Tensor  # [T * Hkv + 1] int32, start of each row's page list
    row_indptr_cpu: torch.Tensor
    last_page_len: torch.Tensor  # [T * Hkv] int32, keys in each row's last (own) page
    last_page_len_cpu: torch.Tensor
    page_ids: torch.Tensor  # [T * Hkv * topk] int32, virtual page ids, written by the index kernel
    max_row_pages: int
    scan_splits: int  # index-scan programs per request

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.shape.num_kv_heads


def token_positions_cpu(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of each new token's request and position (new tokens are the last of each request)."""
    starts = metadata.query_start_loc_cpu.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(metadata.num_requests), query_lens)
    index_in_request = torch.arange(metadata.num_tokens) - starts[request]
    positions = metadata.seq_lens_cpu.to(torch.int64)[request] - query_lens[request] + index_in_request
    return request, positions


def default_scan_splits(num_requests: int, max_candidate_blocks: int, device: torch.device) -> int:
    """Programs per request for the index scan: one wave of resident programs over all SMs, never more
    splits than the longest request has groups of ``_MIN_BLOCKS_PER_SPLIT`` candidate blocks."""
    target = _SCAN_PROGRAMS_PER_SM * multiprocessors(device)
    by_occupancy = target // max(num_requests, 1)  # rounded down: a second, nearly empty wave would be a tail
    by_length = -(-max_candidate_blocks // _MIN_BLOCKS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SCAN_SPLITS))


def plan_sparse_decode(
    metadata: AttentionMetadata,
    shape: SparseDecodeShape,
    device: torch.device,
    scan_splits: int | None = None,
) -> SparseDecodePlan:
    """Plan a decode step from host-known lengths; ``scan_splits`` fixes the index-scan grid (e.g.
    for a CUDA graph captured at a bucket's largest context), otherwise it follows the lengths."""
    if metadata.block_size != shape.block_size:
        raise ValueError(f"metadata.block_size {metadata.block_size} differs from the model's {shape.block_size}")
    request, positions = token_positions_cpu(metadata)
    q_block = positions // shape.block_size
    pages_per_token = torch.clamp(q_block + 1, max=shape.topk)
    pages_per_row = pages_per_token.repeat_interleave(shape.num_kv_heads)
    row_indptr = torch.zeros(pages_per_row.numel() + 1, dtype=torch.int32)
    torch.cumsum(pages_per_row, 0, out=row_indptr[1:])
    last_page_len = (positions % shape.block_size + 1).to(torch.int32).repeat_interleave(shape.num_kv_heads)
    # The candidate (ranked) blocks of a request end where its last token's local blocks begin.
    last_block = (metadata.seq_lens_cpu.to(torch.int64) - 1) // shape.block_size
    candidates = last_block + 1 - torch.clamp(last_block + 1, max=shape.local_blocks)
    max_candidates = int(candidates.max()) if metadata.num_requests else 0
    if scan_splits is None:
        scan_splits = default_scan_splits(metadata.num_requests, max_candidates, device)
    if not 1 <= scan_splits <= MAX_SCAN_SPLITS:
        raise ValueError(f"scan_splits must be in [1, {MAX_SCAN_SPLITS}], got {scan_splits}")
    return SparseDecodePlan(
        shape=shape,
        num_requests=metadata.num_requests,
        num_tokens=metadata.num_tokens,
        max_query_len=metadata.max_query_len,
        token_request=request.to(torch.int32).to(device, non_blocking=True),
        row_indptr=row_indptr.to(device, non_blocking=True),
        row_indptr_cpu=row_indptr,
        last_page_len=last_page_len.to(device, non_blocking=True),
        last_page_len_cpu=last_page_len,
        page_ids=torch.empty(max(int(row_indptr[-1]), 1), dtype=torch.int32, device=device),
        max_row_pages=int(pages_per_token.max()) if metadata.num_tokens else 0,
        scan_splits=scan_splits,
    )
