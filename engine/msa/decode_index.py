"""MSA decode index scoring + block top-k: two Triton kernels, no score tensor in memory.

Semantics are ``reference.index_block_topk`` (HF ``MiniMaxM3VLIndexer``), for every new token of a
decode step (one or a few per request).  The cost is the k-index read: ``context x d x bytes`` per
request and layer (1M tokens, bf16: 256 MiB, ~60 us on an H200), so the kernels are built to
stream each request's index pages exactly once, at full bandwidth, and do everything else on the
fly:

1. ``_scan_kernel``, grid ``(splits, R)``: program ``(s, r)`` streams the ``s``-th slice of request
   ``r``'s candidate pages (the pages before its last token's local blocks).  Per page it computes
   ``keys [B, d] @ q [d, N]`` on the tensor cores (keys as the MMA M dimension; the N columns are
   the request's (token, index head) pairs), reduces each column to the block max, and offers it to
   a running top-K per column held in registers.  The K kept candidates per column go to a small
   partial buffer ``[R, splits, N, KP]``.  The local block(s) are never read: they are always kept.
2. ``_merge_kernel``, grid ``(T, Hidx)``: picks each row's best ``topk - local`` of the
   ``splits x KP`` candidates, appends the local blocks, and writes the selection twice: logical
   block ids ``[Hidx, T, topk]`` (head-major, ``-1`` padded, as in the reference) and the virtual page
   ids the paged attention reads (``SparseDecodePlan.page_ids``, local page last).

Scores and block ids travel packed in one int64 (order-preserving float bits high, inverted id
low), so "higher score, then lower block id" is a single integer comparison: ties go to the lower
block id exactly as in the reference, across splits as well as within one.

The k-index may be fp8 (e4m3): half the scan's bytes; the keys are widened to the queries' type in
registers, so the scores are exact products of the stored keys.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.msa.decode_plan import SparseDecodePlan


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the index scan (bench/msa_decode.py sweeps these on the H200)."""

    # Index pages per MMA ([pages * B, d] @ [d, N]).  One 32 KiB bf16 page per step keeps a program at
    # ~70 KiB of shared memory (double-buffered), so three programs share each H200 SM.
    pages_per_iteration: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Columns of the scan's MMA: at least 16 (tensor-core minimum); (tokens x index heads) beyond
# this many per request go to the prefill path instead.
MAX_DECODE_COLUMNS = 64


@triton.jit
def _pack(score, block_id):
    """(score, block id) -> int64 ordered by score, then by LOWER block id."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits)  # -0.0 ties with +0.0, as in the reference
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) + (0x7FFFFFFF - block_id).to(tl.int64)


@triton.jit
def _unpack_block(packed):
    return (0x7FFFFFFF - (packed & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def _empty_slot(shape_0: tl.constexpr, KP: tl.constexpr):
    """Distinct keys below every real candidate (a -inf score), one per top-K slot."""
    ninf = tl.full([shape_0, KP], float("-inf"), tl.float32)
    return _pack(ninf, 0x7FFFFFFF - tl.arange(0, KP)[None, :])


@triton.jit
def _scan_kernel(
    q_ptr, key_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, partial_ptr,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_pt, num_splits,
    HIDX: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr, KP: tl.constexpr,
    LOCAL: tl.constexpr, PAGES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    request = tl.program_id(1)
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)

    # Column n is (token n // HIDX of the request, index head n % HIDX).
    cols = tl.arange(0, N)
    token = cols // HIDX
    col_ok = token < q_len
    q_block = (seq_len - q_len + token) // B
    first_local = q_block + 1 - tl.minimum(q_block + 1, LOCAL)  # column's candidates: blocks < this
    last_block = (seq_len - 1) // B
    num_candidates = last_block + 1 - tl.minimum(last_block + 1, LOCAL)
    per_split = (num_candidates + num_splits - 1) // num_splits
    block_lo = split * per_split
    block_hi = tl.minimum(block_lo + per_split, num_candidates)

    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + (q_start + token)[None, :].to(tl.int64) * stride_qt + (cols % HIDX)[None, :] * stride_qh
        + dims[:, None],
        mask=col_ok[None, :],
        other=0.0,
    )  # [D, N]  # fmt: skip
    # PAGES pages per iteration: row i of the [PAGES * B, D] key tile is key i % B of page i // B.
    rows = tl.arange(0, PAGES * B)
    row_in_page = rows % B
    page_of_row = rows // B
    page_slot = tl.arange(0, PAGES)[:, None]
    top = _empty_slot(N, KP)  # [N, KP] running top-K per column
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    for first in range(block_lo, block_hi, PAGES):
        row_page = tl.full([PAGES * B], 0, tl.int64)
        for p in tl.static_range(PAGES):
            page = tl.load(page_row + first + p, mask=first + p < block_hi, other=0).to(tl.int64)
            row_page = tl.where(page_of_row == p, page, row_page)
        keys = tl.load(
            key_ptr + row_page[:, None] * stride_kp + row_in_page[:, None] * stride_kb + dims[None, :],
            mask=(first + page_of_row < block_hi)[:, None],
            other=0.0,
        )  # [PAGES * B, D]
        # An fp8 k-index (half the bytes of the scan) is widened to the queries' type in registers.
        scores = tl.dot(keys.to(q.dtype), q, input_precision=INPUT_PRECISION)  # [PAGES * B, N] fp32
        block_max = tl.max(tl.reshape(scores, [PAGES, B, N]), axis=1)  # [PAGES, N]
        for p in tl.static_range(PAGES):
            block = first + p
            score = tl.max(tl.where(page_slot == p, block_max, float("-inf")), axis=0)  # [N]
            candidate = _pack(score, tl.full([N], 0, tl.int32) + block)
            worst = tl.min(top, axis=1)
            take = (candidate > worst) & (block < first_local) & (block < block_hi)
            top = tl.where((top == worst[:, None]) & take[:, None], candidate[:, None], top)
    slots = tl.arange(0, KP)
    out = partial_ptr + ((request * num_splits + split) * N).to(tl.int64) * KP
    tl.store(out + cols[:, None] * KP + slots[None, :], top)


@triton.jit
def _merge_kernel(
    partial_ptr, token_request_ptr, query_start_ptr, positions_ptr, page_table_ptr, row_indptr_ptr,
    selected_ptr, page_ids_ptr, num_tokens, num_splits, stride_pt,
    HIDX: tl.constexpr, B: tl.constexpr, N: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(token_request_ptr + token)
    col = (token - tl.load(query_start_ptr + request)) * HIDX + head
    position = tl.load(positions_ptr + token)
    q_block = (position // B).to(tl.int32)
    num_local = tl.minimum(q_block + 1, LOCAL)
    first_local = q_block + 1 - num_local
    num_ranked = tl.minimum(TOPK - num_local, first_local)

    splits = tl.arange(0, SP)[:, None]
    slots = tl.arange(0, KP)[None, :]
    base = partial_ptr + (request * num_splits).to(tl.int64) * N * KP + col * KP
    floor = _empty_slot(SP, KP)
    cand = tl.load(base + splits * (N * KP) + slots, mask=splits < num_splits, other=floor)
    # Take the best remaining candidate TOPK - 1 times (at most that many are ranked); every pick
    # is unique, so removing it by value removes exactly one entry.
    out = tl.arange(0, TOPK_P)
    picked = tl.full([TOPK_P], -1, tl.int32)
    for j in tl.static_range(TOPK - 1):
        best = tl.max(tl.max(cand, axis=1), axis=0)
        picked = tl.where(out == j, _unpack_block(best), picked)
        cand = tl.where(cand == best, floor, cand)
    is_ranked = out < num_ranked
    is_local = (out >= num_ranked) & (out < num_ranked + num_local)
    block = tl.where(is_ranked, picked, tl.where(is_local, first_local + out - num_ranked, -1))
    tl.store(selected_ptr + (head * num_tokens + token).to(tl.int64) * TOPK + out, block, mask=out < TOPK)

    valid = block >= 0
    page = tl.load(page_table_ptr + request.to(tl.int64) * stride_pt + block, mask=valid, other=0)
    row_start = tl.load(row_indptr_ptr + token * HIDX + head)
    tl.store(page_ids_ptr + row_start + out, page * HIDX + head, mask=valid)


def check_decode_inputs(index_q: torch.Tensor, index_key_cache: torch.Tensor, metadata: AttentionMetadata,
                        plan: SparseDecodePlan) -> None:  # fmt: skip
    shape = plan.shape
    if index_q.shape != (metadata.num_tokens, shape.num_kv_heads, shape.index_head_dim):
        raise ValueError(
            f"index_q has shape {tuple(index_q.shape)}, expected "
            f"({metadata.num_tokens}, {shape.num_kv_heads}, {shape.index_head_dim}) (index heads = KV heads)"
        )
    if index_key_cache.dim() != 3 or index_key_cache.shape[1:] != (shape.block_size, shape.index_head_dim):
        raise ValueError(
            f"index_key_cache has shape {tuple(index_key_cache.shape)}, "
            f"expected [num_pages, {shape.block_size}, {shape.index_head_dim}]"
        )
    if index_key_cache.dtype not in (index_q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"index_key_cache must be {index_q.dtype} (as index_q) or float8_e4m3fn, "
                         f"not {index_key_cache.dtype}")  # fmt: skip
    if index_q.stride(-1) != 1 or index_key_cache.stride(-1) != 1:
        raise ValueError("index_q and index_key_cache need a contiguous last dimension")
    if shape.num_kv_heads * plan.max_query_len > MAX_DECODE_COLUMNS:
        raise ValueError(
            f"{plan.max_query_len} tokens x {shape.num_kv_heads} index heads per request exceed the decode "
            f"indexer's {MAX_DECODE_COLUMNS} columns: use the prefill indexer"
        )
    if shape.index_head_dim < 16 or shape.index_head_dim & (shape.index_head_dim - 1):
        raise ValueError(f"index_head_dim must be a power of two >= 16, got {shape.index_head_dim}")


def scan_index_pages(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
) -> torch.Tensor:
    """Step 1: every (request, split)'s best candidates, packed: ``[R, splits, N, KP]`` int64."""
    check_decode_inputs(index_q, index_key_cache, metadata, plan)
    config = config or ScanConfig()
    shape = plan.shape
    num_heads, head_dim = index_q.shape[1:]
    columns = max(16, triton.next_power_of_2(num_heads * plan.max_query_len))
    slots = triton.next_power_of_2(max(shape.topk - 1, 1))
    splits = plan.scan_splits
    partial = torch.empty((plan.num_requests, splits, columns, slots), dtype=torch.int64, device=index_q.device)
    if plan.num_requests == 0:
        return partial
    _scan_kernel[(splits, plan.num_requests)](
        index_q, index_key_cache, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, partial,
        index_q.stride(0), index_q.stride(1), index_key_cache.stride(0), index_key_cache.stride(1),
        metadata.page_table.stride(0), splits,
        HIDX=num_heads, D=head_dim, B=shape.block_size, N=columns, KP=slots, LOCAL=shape.local_blocks,
        PAGES=config.pages_per_iteration, INPUT_PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return partial


def merge_selection(partial: torch.Tensor, metadata: AttentionMetadata, plan: SparseDecodePlan) -> torch.Tensor:
    """Step 2: each row's final selection from ``scan_index_pages``' candidates; fills ``plan.page_ids``
    and returns the logical block ids ``[Hidx, T, topk]`` int32."""
    shape = plan.shape
    num_tokens, num_heads = plan.num_tokens, shape.num_kv_heads
    selected = torch.empty((num_heads, num_tokens, shape.topk), dtype=torch.int32, device=partial.device)
    if num_tokens == 0:
        return selected
    _, splits, columns, slots = partial.shape
    splits_padded = triton.next_power_of_2(splits)
    _merge_kernel[(num_tokens, num_heads)](
        partial, plan.token_request, metadata.query_start_loc, metadata.positions, metadata.page_table,
        plan.row_indptr, selected, plan.page_ids, num_tokens, splits, metadata.page_table.stride(0),
        HIDX=num_heads, B=shape.block_size, N=columns, KP=slots, SP=splits_padded,
        TOPK=shape.topk, TOPK_P=triton.next_power_of_2(shape.topk), LOCAL=shape.local_blocks,
        num_warps=4 if splits_padded * slots <= 4096 else 8,  # ~32 candidates (64 registers) per thread
    )  # fmt: skip
    return selected


def decode_index_topk(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
) -> torch.Tensor:
    """Select every new token's blocks and write their virtual page ids into ``plan.page_ids``.

    ``index_q`` ``[T, Hidx, d]``: the indexer queries after norm and RoPE (Hidx = Hkv);
    ``index_key_cache`` ``[num_pages, B, d]`` already holds this step's index keys.  Returns the
    logical block ids ``[Hidx, T, topk]`` int32 (layout of ``reference.index_block_topk``).
    """
    partial = scan_index_pages(index_q, index_key_cache, metadata, plan, config)
    return merge_selection(partial, metadata, plan)
