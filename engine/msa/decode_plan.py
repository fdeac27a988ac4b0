"""Host-side plan of one MSA decode step, shared by every sparse layer of the step.

A decode step holds R requests with a few new tokens each (1 for plain decode, more for MTP or a
short chunk).  Everything here follows from host-known lengths (``query_start_loc_cpu``,
``seq_lens_cpu``), so planning never waits for the GPU and the kernels' grids are fixed before
the first layer runs; only the selected page ids are produced on the device, by the index kernel.

Rows of the sparse attention are ``r = t * Hkv + h`` (token, KV head): the "flattened" paged
decode of docs/msa.md#decode-kernels.  Row ``r`` attends ``min(topk, q + 1)`` pages (``q`` = the token's block),
the token's own block last with ``last_page_len = position % B + 1`` keys; every other page is
full.  Page ids are virtual: ``page * Hkv + h`` addresses the ``[B, D]`` tile of KV head ``h`` in
the HND cache viewed as ``[num_pages * Hkv, 1, B, D]``.
"""

from dataclasses import dataclass

import numpy as np
import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.msa.launch import multiprocessors

# Index-scan programs per SM: the scan keeps ~70 KiB of shared memory, so three are resident per H200
# SM; one full wave of them streams the k-index with no tail.
SCAN_PROGRAMS_PER_SM = 3
# Fewest index pages one scan program streams, so short contexts do not launch empty programs.
_MIN_BLOCKS_PER_SPLIT = 4
# Most splits of one request's index scan: the merge ranks one list head per split and column.
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
    # Zeroed once; each kernel that counts finished programs with them leaves them zero again.
    scan_counters: torch.Tensor  # [R] int32, the index scan's programs done per request
    attention_counters: torch.Tensor  # [T * Hkv] int32, the Triton attention's splits done per row

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.shape.num_kv_heads


def token_positions_cpu(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of each new token's request and position (new tokens are the last of each request)."""
    request, positions = _token_positions(metadata, metadata.is_pure_decode)
    return torch.from_numpy(request), torch.from_numpy(positions)


def _token_positions(metadata: AttentionMetadata, pure_decode: bool) -> tuple[np.ndarray, np.ndarray]:
    """``token_positions_cpu`` in numpy (int64): a handful of numpy operations on tiny arrays cost far less
    than torch's CPU ops, and this runs every step.  A pure-decode step's token r is request r's last."""
    seq_lens = metadata.seq_lens_cpu.numpy().astype(np.int64)
    if pure_decode:
        return np.arange(metadata.num_requests, dtype=np.int64), seq_lens - 1
    starts = metadata.query_start_loc_cpu.numpy().astype(np.int64)
    query_lens = np.diff(starts)
    request = np.repeat(np.arange(metadata.num_requests, dtype=np.int64), query_lens)
    positions = seq_lens[request] - query_lens[request] + np.arange(metadata.num_tokens) - starts[request]
    return request, positions


def default_scan_splits(num_requests: int, max_candidate_blocks: int, device: torch.device,
                        programs_per_sm: int = SCAN_PROGRAMS_PER_SM) -> int:  # fmt: skip
    """Programs per request for the index scan: one wave of ``programs_per_sm`` programs over all SMs,
    never more splits than the longest request has groups of ``_MIN_BLOCKS_PER_SPLIT`` candidate blocks."""
    target = programs_per_sm * multiprocessors(device)
    by_occupancy = target // max(num_requests, 1)  # rounded down: a second, nearly empty wave would be a tail
    by_length = -(-max_candidate_blocks // _MIN_BLOCKS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SCAN_SPLITS))


class DecodePlanBuffers:
    """Device tensors of ``SparseDecodePlan`` that stay put across steps of one token count, so a CUDA
    graph captured once replays over every later step's plan (the runner captures per batch size)."""

    def __init__(self, num_tokens: int, shape: SparseDecodeShape, device: torch.device) -> None:
        rows = num_tokens * shape.num_kv_heads
        self.num_tokens = num_tokens
        self.token_request = torch.zeros(num_tokens, dtype=torch.int32, device=device)
        self.row_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(rows, dtype=torch.int32, device=device)
        self.page_ids = torch.zeros(max(rows * shape.topk, 1), dtype=torch.int32, device=device)
        self.scan_counters = torch.zeros(num_tokens, dtype=torch.int32, device=device)  # R <= T
        self.attention_counters = torch.zeros(rows, dtype=torch.int32, device=device)
        # One pinned staging area, so the per-step copies are asynchronous; the event keeps the next
        # step from overwriting it before the previous copies have left.
        on_cuda = device.type == "cuda"
        self._staging = torch.empty(num_tokens + 2 * rows + 1, dtype=torch.int32, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None

    def fill(self, token_request: torch.Tensor, row_indptr: torch.Tensor, last_page_len: torch.Tensor) -> None:
        if token_request.numel() != self.num_tokens:
            raise ValueError(f"buffers are for {self.num_tokens} tokens, the step has {token_request.numel()}")
        if self._copied is not None:
            self._copied.synchronize()
        parts = (token_request, row_indptr, last_page_len)
        targets = (self.token_request, self.row_indptr, self.last_page_len)
        offset = 0
        for part, target in zip(parts, targets, strict=True):
            staged = self._staging[offset : offset + part.numel()]
            staged.copy_(part)
            target.copy_(staged, non_blocking=True)
            offset += part.numel()
        if self._copied is not None:
            self._copied.record()


def plan_sparse_decode(
    metadata: AttentionMetadata,
    shape: SparseDecodeShape,
    device: torch.device,
    scan_splits: int | None = None,
    buffers: DecodePlanBuffers | None = None,
    scan_programs_per_sm: int = SCAN_PROGRAMS_PER_SM,
) -> SparseDecodePlan:
    """Plan a decode step from host-known lengths.

    Launch sizes follow the page table's width (the longest context the step's buffers can hold),
    not the step's own lengths, so a CUDA graph captured over fixed-width buffers stays valid; an
    eager step's page table is exactly as wide as its longest request.  ``scan_splits`` overrides
    the index scan's programs per request (else ``scan_programs_per_sm`` per SM over all requests).
    With ``buffers``, the plan's device tensors are those buffers (filled here), otherwise fresh tensors.
    """
    if metadata.block_size != shape.block_size:
        raise ValueError(f"metadata.block_size {metadata.block_size} differs from the model's {shape.block_size}")
    pure_decode = metadata.is_pure_decode
    request_np, positions = _token_positions(metadata, pure_decode)
    heads = shape.num_kv_heads
    pages_per_token = np.minimum(positions // shape.block_size + 1, shape.topk)
    row_indptr_np = np.zeros(len(positions) * heads + 1, dtype=np.int32)
    np.cumsum(np.repeat(pages_per_token, heads), out=row_indptr_np[1:])
    row_indptr = torch.from_numpy(row_indptr_np)
    last_page_len = torch.from_numpy(np.repeat((positions % shape.block_size + 1).astype(np.int32), heads))
    width = metadata.page_table.shape[1]
    if scan_splits is None:
        # Candidate blocks are those before the local ones: at most width - local_blocks per request.
        scan_splits = default_scan_splits(metadata.num_requests, max(0, width - shape.local_blocks), device,
                                          scan_programs_per_sm)  # fmt: skip
    if not 1 <= scan_splits <= MAX_SCAN_SPLITS:
        raise ValueError(f"scan_splits must be in [1, {MAX_SCAN_SPLITS}], got {scan_splits}")
    request = torch.from_numpy(request_np.astype(np.int32))
    if buffers is not None:
        buffers.fill(request, row_indptr, last_page_len)
        tensors = (buffers.token_request, buffers.row_indptr, buffers.last_page_len, buffers.page_ids,
                   buffers.scan_counters, buffers.attention_counters)  # fmt: skip
    else:
        page_ids = torch.empty(max(int(row_indptr[-1]), 1), dtype=torch.int32, device=device)
        moved = (upload(t, device) for t in (request, row_indptr, last_page_len))
        counters = (
            torch.zeros(n, dtype=torch.int32, device=device)
            for n in (metadata.num_requests, len(request) * shape.num_kv_heads)
        )
        tensors = (*moved, page_ids, *counters)
    token_request_dev, row_indptr_dev, last_page_len_dev, page_ids_dev, scan_counters, attention_counters = tensors
    return SparseDecodePlan(
        shape=shape,
        num_requests=metadata.num_requests,
        num_tokens=len(positions),
        max_query_len=1 if pure_decode else metadata.max_query_len,
        token_request=token_request_dev,
        row_indptr=row_indptr_dev,
        row_indptr_cpu=row_indptr,
        last_page_len=last_page_len_dev,
        last_page_len_cpu=last_page_len,
        page_ids=page_ids_dev,
        max_row_pages=min(shape.topk, width),
        scan_splits=scan_splits,
        scan_counters=scan_counters,
        attention_counters=attention_counters,
    )
