"""Invert per-query block selections into per-(chunk, KV head, block) query lists (CSR) on the device.

Buckets: ``bucket = (chunk * Hkv + h) * NB + global_block`` where global blocks number every
request's logical blocks consecutively (``prefill_plan.global_blocks``) and a chunk is a run of
``chunk_tokens`` flat token rows (the sparse prefill bounds its partial-output workspace per chunk).
Entries are ``t_local * K + slot``: the token row within its chunk and the selection column, which
is also where the block's partial output goes.  A selection entry counts only if it names a block
at or before the query's own block (``-1`` padding and future or out-of-range blocks are dropped,
exactly as causal masking would drop them).

Work items split each bucket into runs of at most ``queries_per_item`` entries so one hot block
(a sink every query picks) cannot leave one program running long after the others.  Each item is one
32-byte row of ``items`` holding everything its program needs before it loads K and V (head, entry
range, page, first key position, key count), so the attention kernel starts with one dependent load;
chunk ``c``'s items start at row ``c * items_per_chunk`` (a host-known bound) and unused rows have
head -1, so no device-side item count is needed either.

Order within a bucket comes from atomics and is arbitrary; results do not depend on it because
each (query, block) partial is computed by one row of one program, independently of its neighbours.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.msa.prefill_plan import GlobalBlocks

_ENTRIES_PER_PROGRAM = 1024
_BUCKETS_PER_PROGRAM = 128


# Columns of a work-item row (int32), constexprs so kernels can use them (``int()`` on the host); a
# row is padded to ITEM_FIELDS columns, one aligned 32-byte load.
ITEM_HEAD = tl.constexpr(0)
ITEM_BLOCK = tl.constexpr(1)  # global block id
ITEM_FIRST = tl.constexpr(2)  # first entry
ITEM_END = tl.constexpr(3)  # one past the last entry
ITEM_PAGE = tl.constexpr(4)
ITEM_FIRST_KEY = tl.constexpr(5)  # position of the block's first key
ITEM_NUM_KEYS = tl.constexpr(6)
ITEM_FIELDS = tl.constexpr(8)


@dataclass(frozen=True)
class BlockQueries:
    row_ptr: torch.Tensor  # [num_buckets + 1] int32, entries of bucket b: row_ptr[b] .. row_ptr[b + 1]
    entries: torch.Tensor  # [Hkv * T * K] int32, t_local * K + slot (only the first row_ptr[-1] are used)
    items: torch.Tensor  # [num_chunks * items_per_chunk, ITEM_FIELDS] int32, ITEM_* columns; head -1: unused
    items_per_chunk: int  # rows reserved per chunk (an upper bound on any chunk's items)
    num_chunks: int
    chunk_tokens: int
    num_blocks: int  # NB, global blocks in the batch
    queries_per_item: int


def items_per_chunk_bound(
    chunk_tokens: int, num_tokens: int, num_kv_heads: int, topk: int, num_blocks: int, per_item: int
) -> int:
    """Upper bound on the work items of any chunk: each non-empty bucket has one partial item at
    most; the full ones are bounded by the chunk's entry count."""
    entries = num_kv_heads * min(chunk_tokens, num_tokens) * topk
    return min(num_kv_heads * num_blocks, entries) + triton.cdiv(entries, per_item)


# fmt: off
@triton.jit
def _entry_buckets(
    e, n_entries, sel_ptr, positions_ptr, token_request_ptr, request_first_block_ptr, n_tokens, stride_sh, stride_st,
    K: tl.constexpr, B: tl.constexpr, HKV: tl.constexpr, NB, CHUNK,
):
    """Bucket of each flat selection entry ``e = (h * T + t) * K + slot``, or -1 when it is dropped."""
    in_range = e < n_entries
    slot = e % K
    token = (e // K) % n_tokens
    head = e // (K * n_tokens)
    block = tl.load(sel_ptr + head * stride_sh + token * stride_st + slot, mask=in_range, other=-1).to(tl.int32)
    position = tl.load(positions_ptr + token, mask=in_range, other=0)
    valid = in_range & (block >= 0) & (block <= (position // B).to(tl.int32))
    request = tl.load(token_request_ptr + token, mask=valid, other=0)
    first_block = tl.load(request_first_block_ptr + request, mask=valid, other=0)
    chunk = token // CHUNK
    bucket = (chunk * HKV + head) * NB + first_block + block
    entry = (token % CHUNK) * K + slot
    return tl.where(valid, bucket, -1), entry


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
@triton.jit(do_not_specialize=["n_entries", "n_tokens", "NB", "CHUNK"])
def _bucket_pass_kernel(
    sel_ptr, positions_ptr, token_request_ptr, request_first_block_ptr, counts_ptr, row_ptr_ptr, rank_ptr,
    entries_ptr, n_entries, n_tokens, stride_sh, stride_st, NB, CHUNK,
    K: tl.constexpr, B: tl.constexpr, HKV: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr,
):
    """Counting sort of the entries into buckets: the first pass (``FILL=False``) counts each
    bucket and records every entry's rank in it; the second writes each entry at its row's start
    plus its rank."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bucket, entry = _entry_buckets(
        e, n_entries, sel_ptr, positions_ptr, token_request_ptr, request_first_block_ptr,
        n_tokens, stride_sh, stride_st, K, B, HKV, NB, CHUNK,
    )
    valid = bucket >= 0
    if FILL:
        start = tl.load(row_ptr_ptr + bucket, mask=valid, other=0)
        rank = tl.load(rank_ptr + e, mask=valid, other=0)
        tl.store(entries_ptr + start + rank, entry.to(tl.int32), mask=valid)
    else:
        rank = tl.atomic_add(counts_ptr + bucket, 1, mask=valid, sem="relaxed")
        tl.store(rank_ptr + e, rank, mask=valid)


@triton.jit(do_not_specialize=["n_buckets", "queries_per_item", "items_per_chunk", "NB"])
def _items_kernel(
    row_ptr_ptr, item_ptr_ptr, block_page_ptr, block_first_pos_ptr, block_num_keys_ptr, items_ptr,
    n_buckets, queries_per_item, items_per_chunk, NB,
    HKV: tl.constexpr, BLOCK: tl.constexpr,
):
    """Write one row per run of ``queries_per_item`` entries of each bucket (module docstring)."""
    bucket = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = bucket < n_buckets
    chunk = bucket // (HKV * NB)
    block = bucket % NB
    first_item = tl.load(item_ptr_ptr + bucket, mask=in_range, other=0)
    num_items = tl.load(item_ptr_ptr + bucket + 1, mask=in_range, other=0) - first_item
    # Row within the chunk's reserved range: items before this bucket since the chunk's first one.
    chunk_first_item = tl.load(item_ptr_ptr + chunk * HKV * NB, mask=in_range, other=0)
    row = (chunk * items_per_chunk + first_item - chunk_first_item).to(tl.int64) * ITEM_FIELDS
    first_entry = tl.load(row_ptr_ptr + bucket, mask=in_range, other=0)
    end_entry = tl.load(row_ptr_ptr + bucket + 1, mask=in_range, other=0)
    page = tl.load(block_page_ptr + block, mask=in_range, other=0).to(tl.int32)
    first_key = tl.load(block_first_pos_ptr + block, mask=in_range, other=0)
    num_keys = tl.load(block_num_keys_ptr + block, mask=in_range, other=0)
    head = (bucket // NB) % HKV
    for j in range(tl.max(num_items, axis=0)):
        live = j < num_items
        lo = first_entry + j * queries_per_item
        out = items_ptr + row + j * ITEM_FIELDS
        tl.store(out + ITEM_HEAD, head, mask=live)
        tl.store(out + ITEM_BLOCK, block, mask=live)
        tl.store(out + ITEM_FIRST, lo, mask=live)
        tl.store(out + ITEM_END, tl.minimum(lo + queries_per_item, end_entry), mask=live)
        tl.store(out + ITEM_PAGE, page, mask=live)
        tl.store(out + ITEM_FIRST_KEY, first_key, mask=live)
        tl.store(out + ITEM_NUM_KEYS, num_keys, mask=live)


# fmt: on


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, 0, dtype=torch.int32, out=out[1:])
    return out


def build_block_queries(
    selection: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    blocks: GlobalBlocks,
    block_size: int,
    chunk_tokens: int,
    queries_per_item: int,
) -> BlockQueries:
    """CSR of ``selection`` ``[Hkv, T, K]`` (module docstring); no host synchronisation."""
    num_kv_heads, num_tokens, topk = selection.shape
    device = selection.device
    num_chunks = max(1, triton.cdiv(num_tokens, chunk_tokens))
    num_buckets = num_chunks * num_kv_heads * blocks.count
    n_entries = num_kv_heads * num_tokens * topk
    counts = torch.zeros(num_buckets, dtype=torch.int32, device=device)
    rank = torch.empty(n_entries, dtype=torch.int32, device=device)
    entries = torch.empty(n_entries, dtype=torch.int32, device=device)
    common = (selection, positions, token_request, blocks.first)
    shape = (n_entries, num_tokens, selection.stride(0), selection.stride(1), blocks.count, chunk_tokens)
    consts = dict(K=topk, B=block_size, HKV=num_kv_heads, BLOCK=_ENTRIES_PER_PROGRAM)
    grid = (triton.cdiv(n_entries, _ENTRIES_PER_PROGRAM),)
    row_ptr = torch.zeros(num_buckets + 1, dtype=torch.int32, device=device)
    if n_entries:
        _bucket_pass_kernel[grid](*common, counts, row_ptr, rank, entries, *shape, FILL=False, **consts)
        torch.cumsum(counts, 0, dtype=torch.int32, out=row_ptr[1:])
        _bucket_pass_kernel[grid](*common, counts, row_ptr, rank, entries, *shape, FILL=True, **consts)
    item_ptr = _exclusive_cumsum((counts + queries_per_item - 1) // queries_per_item)
    per_chunk = items_per_chunk_bound(chunk_tokens, num_tokens, num_kv_heads, topk, blocks.count, queries_per_item)
    items = torch.full((num_chunks * per_chunk, int(ITEM_FIELDS)), -1, dtype=torch.int32, device=device)
    if num_buckets:
        _items_kernel[(triton.cdiv(num_buckets, _BUCKETS_PER_PROGRAM),)](
            row_ptr, item_ptr, blocks.page, blocks.first_position, blocks.num_keys, items,
            num_buckets, queries_per_item, per_chunk, blocks.count,
            HKV=num_kv_heads, BLOCK=_BUCKETS_PER_PROGRAM,
        )  # fmt: skip
    return BlockQueries(
        row_ptr=row_ptr,
        entries=entries,
        items=items,
        items_per_chunk=per_chunk,
        num_chunks=num_chunks,
        chunk_tokens=chunk_tokens,
        num_blocks=blocks.count,
        queries_per_item=queries_per_item,
    )
