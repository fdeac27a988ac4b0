"""MSA decode index scoring + block top-k: one Triton launch, no score tensor in memory.

Semantics are ``reference.index_block_topk`` (HF ``MiniMaxM3VLIndexer``), for every new token of a
decode step (one or a few per request).  The cost is the k-index read: ``context x d x bytes`` per
request and layer (1M tokens, bf16: 256 MiB, ~60 us on an H200), so the kernel streams each
request's index pages exactly once, at full bandwidth, and does everything else on the fly:

1. Scan, grid ``(splits, R)`` (``(R, splits)`` split-major): program ``(s, r)`` streams the ``s``-th slice
   of request ``r``'s candidate pages (the pages before its last token's local blocks).  Per page it computes
   ``keys [B, d] @ q [d, N]`` on the tensor cores (keys as the MMA M dimension; the N columns are
   the request's (token, index head) pairs), reduces each column to the block max, and offers it to
   a running top-K per column held in registers.  Each program leaves its K candidates per column
   (a list) and their best one (the list's head) in small buffers.  The local block(s) are never
   read: they are always kept.
2. Merge, in the LAST scan program of each request to finish (a per-request atomic ticket counter,
   reset by that program, so no extra launch and no memset): of the ``splits`` lists, only those
   whose heads rank among the best ``topk - local`` heads can hold a selected block (any other
   list's head already has that many better candidates above it), so the merge ranks the heads,
   gathers those few lists and ranks their entries.  It appends the local blocks and writes the
   selection twice: logical block ids ``[Hidx, T, topk]`` (head-major, ``-1`` padded, as in the
   reference) and the virtual page ids the paged attention reads (``SparseDecodePlan.page_ids``,
   local page last).  Steps with many columns per request (MTP) merge in a second launch instead,
   one program per group of columns.

Scores and block ids travel packed in one int64 (order-preserving float bits high, inverted id
low), so "higher score, then lower block id" is a single integer comparison: ties go to the lower
block id exactly as in the reference, across splits as well as within one.

The k-index may be fp8 (e4m3): half the scan's bytes; the keys are widened (through fp16) to the queries'
type in registers, so the scores are exact products of the stored keys.

With ``store`` (decode steps of one token per request), the scan's first program of each request
also writes the step's new K, V and index key into the paged cache (``msa.store``): that token
sits in the request's last block, which is local and so never scanned, and the attention that
reads it is a later launch.  That saves the store's own launch.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import LayerKVCache
from m3stack.engine.msa.decode_plan import SparseDecodePlan, SparseDecodeShape
from m3stack.engine.msa.store import check_store_inputs, store_launch_args, store_token


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the index scan (bench/msa_decode.py sweeps these on the H200)."""

    # Index pages per MMA ([pages * B, d] @ [d, N]).  One 32 KiB bf16 page per step keeps a program at
    # ~70 KiB of shared memory (double-buffered), so three programs share each H200 SM.
    pages_per_iteration: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Merge in the scan's last program per request (one launch) rather than in a second launch.
    fused_merge: bool = True
    # Load the next iteration's page ids during this one, so a key tile's address never waits on a load of
    # the same iteration (the prefill indexer's fix for Triton's pipeliner); off until the H200 sweep says.
    page_ids_ahead: bool = False
    # Launch order: the same split of every request side by side, instead of every split of one request.  Requests
    # that share prefix pages (agentic serving: one long prefix, many requests) then read each page while the other
    # requests' programs for it are resident, from L2 rather than HBM; other batches read what they read before.
    split_major: bool = False
    # Warps of the merge's own launch (``fused_merge`` off): at one, its 30 sequential rankings reduce within
    # a warp, with no shared-memory round trip and barrier each; it ranks 512 keys a program per warp.  Lists of
    # fewer than 16 slots are merged by 4 warps whatever this says (``_FEW_WARP_MERGE_MIN_SLOTS``).
    merge_warps: int = 4
    # Scan pages that several requests share (one agentic prefix) once for all of them: a program scores a split's
    # key tiles for up to ``shared_group`` consecutive requests whose page tables hold the same pages over that
    # split, in the MMA columns one decode request leaves unused (1 token x 4 index heads of 16).  Splits then
    # cover the same blocks in every request (sized from the page table's width), and the merge is its own launch.
    shared_pages: bool = False
    shared_group: int = 4

    def __post_init__(self) -> None:
        if self.merge_warps not in (1, 2, 4, 8):
            raise ValueError(f"merge_warps must be 1, 2, 4 or 8, got {self.merge_warps}")
        if self.shared_group < 1 or self.shared_group & (self.shared_group - 1) or self.shared_group > 16:
            raise ValueError(f"shared_group must be a power of two from 1 to 16, got {self.shared_group}")


# Columns of the scan's MMA: at least 16 (tensor-core minimum); (tokens x index heads) beyond
# this many per request go to the prefill path instead.
MAX_DECODE_COLUMNS = 64
# Fewest columns the lists and the merge are laid out for.  A merge program of 2 columns faults with an illegal
# address on the H200: a TP=2 rank's 2 index heads x 1 decode token (the 2x H200 engine's fault, repro on one GPU,
# 2026-12-01), and a two-warp merge launch ranking 2 of 4 columns at 512 splits (the H200 sweep, the same day);
# 1, 4 and 16 run clean.  The padding columns belong to no token and are never stored.
_MIN_MERGE_COLUMNS = 4
# Int64 keys a merge program ranks at once (heads of all splits x its columns) per warp: 16 per thread.
# More columns than fit the scan's program (4 warps) are merged in a second launch.
_MERGE_KEYS_PER_WARP = 512
# Page ids two requests' rows are compared in at once (``ScanConfig.shared_pages``).
_PAGE_COMPARE_CHUNK = 32
_FUSED_MERGE_WARPS = 4
# Fewest list slots (top-k minus local blocks, to a power of two) a merge launch of fewer than 4 warps is run
# for.  On the H200 (2026-12-01, every split count from 8 to 256), lists of 4 slots (the tiny model's top-4)
# merged by 1 warp select other blocks than 4 warps do, and by 2 warps fault with an illegal address; M3's 16
# slots merge identically at 1, 2 and 4 warps, also at a TP=2 rank's 2 index heads.
_FEW_WARP_MERGE_MIN_SLOTS = 16
# Below every packed key, real or empty.
_FLOOR = -(2**63)


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
    """Distinct keys below every real candidate (a -inf score), one per top-K slot; their block ids
    (``0x7FFFFFFF - slot``) lie past every real block."""
    ninf = tl.full([shape_0, KP], float("-inf"), tl.float32)
    return _pack(ninf, 0x7FFFFFFF - tl.arange(0, KP)[None, :])


@triton.jit
def _take_best(keys, PICKS: tl.constexpr, PICKS_P: tl.constexpr, FLOOR: tl.constexpr):
    """The ``PICKS`` largest distinct keys of each row of ``keys`` ``[C, M]``, best first: ``[C, PICKS_P]``
    (FLOOR past the picks, or where a row runs out).  A pick removes every copy of its key."""
    out = tl.arange(0, PICKS_P)[None, :]
    picked = tl.full([keys.shape[0], PICKS_P], FLOOR, tl.int64)
    for j in tl.static_range(PICKS):
        best = tl.max(keys, axis=1)
        picked = tl.where(out == j, best[:, None], picked)
        keys = tl.where(keys == best[:, None], FLOOR, keys)
    return picked


@triton.jit
def _request_span(query_start_ptr, seq_lens_ptr, request, num_splits, B: tl.constexpr, LOCAL: tl.constexpr):
    """A request's new tokens, context and scan slices: candidate blocks are those before the last
    token's local blocks, ``per_split`` of them to a scan program."""
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)
    last_block = (seq_len - 1) // B
    num_candidates = last_block + 1 - tl.minimum(last_block + 1, LOCAL)
    per_split = (num_candidates + num_splits - 1) // num_splits
    return q_start, q_len, seq_len, num_candidates, per_split


@triton.jit
def _merge_columns(
    list_ptr, head_ptr, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr,
    request, q_start, q_len, seq_len, per_split, num_splits, num_tokens, col_lo,
    HIDX: tl.constexpr, B: tl.constexpr, CS: tl.constexpr, CPB: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr,
    LOCAL: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    """Final selection of columns ``col_lo .. col_lo + CPB - 1`` of ``request`` from the scan's lists.

    Lists ``[R, splits, CS, KP]`` and heads ``[R, splits, CS]`` were written by other programs of
    this launch (or an earlier one): they are read from L2 (``.cg``), never from a stale L1 line.
    """
    cols = col_lo + tl.arange(0, CPB)
    split_ids = tl.arange(0, SP)[None, :]
    first = request.to(tl.int64) * num_splits
    heads = tl.load(head_ptr + (first + split_ids) * CS + cols[:, None], mask=split_ids < num_splits, other=FLOOR,
                    cache_modifier=".cg")  # fmt: skip
    # Only lists whose head ranks among the best KR heads can hold a selected block.
    best_heads = _take_best(heads, KR, KR_P, FLOOR)  # [CPB, KR_P]
    owner = _unpack_block(best_heads) // tl.maximum(per_split, 1)  # empty / FLOOR heads: past every split
    owned = owner < num_splits
    slots = tl.arange(0, KP)[None, None, :]
    lists = tl.load(
        list_ptr + ((first + owner[:, :, None]) * CS + cols[:, None, None]) * KP + slots,
        mask=owned[:, :, None], other=FLOOR, cache_modifier=".cg",
    )  # [CPB, KR_P, KP]  # fmt: skip
    picked = _take_best(tl.reshape(lists, [CPB, KR_P * KP]), KR, TOPK_P, FLOOR)  # [CPB, TOPK_P]

    # Column c is (token c // HIDX of the request, index head c % HIDX).
    token_in_request = cols // HIDX
    head = cols % HIDX
    col_ok = token_in_request < q_len
    token = q_start + token_in_request
    q_block = (seq_len - q_len + token_in_request) // B
    num_local = tl.minimum(q_block + 1, LOCAL)
    first_local = q_block + 1 - num_local
    num_ranked = tl.minimum(TOPK - num_local, first_local)  # at most KR
    out = tl.arange(0, TOPK_P)[None, :]
    is_ranked = out < num_ranked[:, None]
    is_local = (out >= num_ranked[:, None]) & (out < (num_ranked + num_local)[:, None])
    block = tl.where(is_ranked, _unpack_block(picked),
                     tl.where(is_local, first_local[:, None] + out - num_ranked[:, None], -1))  # fmt: skip
    keep = col_ok[:, None] & (out < TOPK)
    tl.store(selected_ptr + (head * num_tokens + token)[:, None].to(tl.int64) * TOPK + out, block, mask=keep)
    valid = keep & (block >= 0)
    page = tl.load(page_row + block, mask=valid, other=0)
    row_start = tl.load(row_indptr_ptr + token * HIDX + head, mask=col_ok, other=0)
    tl.store(page_ids_ptr + row_start[:, None] + out, page * HIDX + head[:, None], mask=valid)


@triton.jit
def _row_pages(page_row, first, block_hi, page_of_row, PAGES: tl.constexpr, B: tl.constexpr):
    """The page of each row of the key tile of blocks ``first .. first + PAGES - 1`` (0 past ``block_hi``)."""
    row_page = tl.full([PAGES * B], 0, tl.int64)
    for p in tl.static_range(PAGES):
        page = tl.load(page_row + first + p, mask=first + p < block_hi, other=0).to(tl.int64)
        row_page = tl.where(page_of_row == p, page, row_page)
    return row_page


@triton.jit
def _scan_pages(
    q, key_ptr, page_row, block_lo, block_hi, column_limit, stride_kp, stride_kb,
    N: tl.constexpr, D: tl.constexpr, B: tl.constexpr, KP: tl.constexpr, PAGES: tl.constexpr,
    PAGE_IDS_AHEAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The running top-K ``[N, KP]`` of blocks ``block_lo .. block_hi - 1`` of one page-table row, scored
    against the queries ``q`` ``[D, N]`` (block max); column n ranks only blocks below ``column_limit[n]``."""
    dims = tl.arange(0, D)
    # PAGES pages per iteration: row i of the [PAGES * B, D] key tile is key i % B of page i // B.
    rows = tl.arange(0, PAGES * B)
    row_in_page = rows % B
    page_of_row = rows // B
    page_slot = tl.arange(0, PAGES)[:, None]
    top = _empty_slot(N, KP)
    if PAGE_IDS_AHEAD:
        next_row_page = _row_pages(page_row, block_lo, block_hi, page_of_row, PAGES, B)
    for first in range(block_lo, block_hi, PAGES):
        if PAGE_IDS_AHEAD:
            row_page = next_row_page
            next_row_page = _row_pages(page_row, first + PAGES, block_hi, page_of_row, PAGES, B)
        else:
            row_page = _row_pages(page_row, first, block_hi, page_of_row, PAGES, B)
        keys = tl.load(
            key_ptr + row_page[:, None] * stride_kp + row_in_page[:, None] * stride_kb + dims[None, :],
            mask=(first + page_of_row < block_hi)[:, None],
            other=0.0,
        )  # [PAGES * B, D]
        # An fp8 k-index (half the bytes of the scan) is widened to the queries' type in registers, through fp16:
        # both steps are exact for e4m3, and e4m3 -> fp16 is one instruction on sm_90 where the direct conversion to
        # bf16 is a longer sequence that bounded the scan (H200, 1M x 1: 47.9 us against 65.0; batch 8: 340 vs 473).
        if keys.dtype == tl.float8e4nv:
            keys = keys.to(tl.float16)
        scores = tl.dot(keys.to(q.dtype), q, input_precision=INPUT_PRECISION)  # [PAGES * B, N] fp32
        block_max = tl.max(tl.reshape(scores, [PAGES, B, N]), axis=1)  # [PAGES, N]
        for p in tl.static_range(PAGES):
            block = first + p
            score = tl.max(tl.where(page_slot == p, block_max, float("-inf")), axis=0)  # [N]
            candidate = _pack(score, tl.full([N], 0, tl.int32) + block)
            worst = tl.min(top, axis=1)
            take = (candidate > worst) & (block < column_limit)
            top = tl.where((top == worst[:, None]) & take[:, None], candidate[:, None], top)
    return top


@triton.jit
def _score_columns(
    q_ptr, key_ptr, page_row, q_start, q_len, seq_len, column, in_use, block_lo, block_hi,
    stride_qt, stride_qh, stride_kp, stride_kb,
    HIDX: tl.constexpr, N: tl.constexpr, D: tl.constexpr, B: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr,
    PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``_scan_pages`` for N columns, column n being token ``column[n] // HIDX`` of a request (its new tokens start
    at ``q_start[n]``, ``q_len[n]`` of them, context ``seq_len[n]``) and index head ``column[n] % HIDX``; columns
    not ``in_use`` or past their request's tokens score nothing.  Each ranks only blocks before its token's local
    blocks."""
    token = column // HIDX
    col_ok = in_use & (token < q_len)
    q_block = (seq_len - q_len + token) // B
    first_local = q_block + 1 - tl.minimum(q_block + 1, LOCAL)
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + (q_start + token)[None, :].to(tl.int64) * stride_qt + (column % HIDX)[None, :] * stride_qh
        + dims[:, None],
        mask=col_ok[None, :],
        other=0.0,
    )  # [D, N]  # fmt: skip
    return _scan_pages(q, key_ptr, page_row, block_lo, block_hi, tl.minimum(first_local, block_hi), stride_kp,
                       stride_kb, N, D, B, KP, PAGES, PAGE_IDS_AHEAD, INPUT_PRECISION)  # fmt: skip


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
# Whether the step's keys are stored here is a runtime flag too, with stand-in store arguments of the same types
# and constexprs otherwise: the CUDA graphs capture pure decode steps (storing), and a mixed step run eagerly
# later (not storing) must find the same compiled kernel rather than compile its own variant mid-serving.
@triton.jit(do_not_specialize=["num_splits", "num_tokens", "stride_pt", "store"])
def _scan_kernel(
    q_ptr, key_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, list_ptr, head_ptr, counter_ptr,
    row_indptr_ptr, selected_ptr, page_ids_ptr,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_pt, num_splits, num_tokens, store,
    # msa.store.store_token's arguments (read only when store is nonzero)
    slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb, stride_ip, stride_ib,
    HIDX: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr, CS: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr,
    LOCAL: tl.constexpr, PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr, SPLIT_MAJOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MERGE: tl.constexpr,
    FLOOR: tl.constexpr, ST_HKV: tl.constexpr, ST_HKV_P: tl.constexpr, ST_D: tl.constexpr,
    ST_D_P: tl.constexpr, ST_DI: tl.constexpr, ST_DI_P: tl.constexpr, ST_HAS_INDEX: tl.constexpr,
):  # fmt: skip
    if SPLIT_MAJOR:
        request = tl.program_id(0)
        split = tl.program_id(1)
    else:
        split = tl.program_id(0)
        request = tl.program_id(1)
    q_start, q_len, seq_len, num_candidates, per_split = _request_span(query_start_ptr, seq_lens_ptr, request,
                                                                       num_splits, B, LOCAL)  # fmt: skip
    if store != 0:  # noqa: SIM102
        if split == 0:
            # The request's one new token (the host checks) lands in its last block: local, never scanned.
            store_token(
                q_start, slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb, stride_ip,
                stride_ib, ST_HKV, ST_HKV_P, ST_D, ST_D_P, ST_DI, ST_DI_P, B, ST_HAS_INDEX,
            )  # fmt: skip

    # Column n is (token n // HIDX of the request, index head n % HIDX).
    cols = tl.arange(0, N)
    block_lo = split * per_split
    block_hi = tl.minimum(block_lo + per_split, num_candidates)
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    top = _score_columns(q_ptr, key_ptr, page_row, q_start, q_len, seq_len, cols, cols < N, block_lo, block_hi,
                         stride_qt, stride_qh, stride_kp, stride_kb, HIDX, N, D, B, KP, LOCAL, PAGES, PAGE_IDS_AHEAD,
                         INPUT_PRECISION)  # fmt: skip
    # This program's list and head per stored column.
    slots = tl.arange(0, KP)
    mine = (request * num_splits + split).to(tl.int64) * CS
    tl.store(list_ptr + (mine + cols[:, None]) * KP + slots[None, :], top, mask=cols[:, None] < CS)
    tl.store(head_ptr + mine + cols, tl.max(top, axis=1), mask=cols < CS)
    if MERGE:
        # Every thread's list stores are issued before the ticket; acq_rel makes them visible to the
        # program that draws the last ticket, and every other program's to it.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + request, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            tl.store(counter_ptr + request, 0)  # the request's other programs are done: ready for the next launch
            _merge_columns(
                list_ptr, head_ptr, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr,
                request, q_start, q_len, seq_len, per_split, num_splits, num_tokens, 0,
                HIDX, B, CS, CS, KP, SP, TOPK, TOPK_P, KR, KR_P, LOCAL, FLOOR,
            )  # fmt: skip


@triton.jit
def _split_end(seq_lens_ptr, request, block_lo, per_split, B: tl.constexpr, LOCAL: tl.constexpr):
    """End of ``request``'s candidate blocks in the split starting at ``block_lo`` (<= block_lo: none)."""
    last_block = (tl.load(seq_lens_ptr + request) - 1) // B
    num_candidates = last_block + 1 - tl.minimum(last_block + 1, LOCAL)
    return tl.minimum(block_lo + per_split, num_candidates)


@triton.jit
def _same_split_pages(page_table_ptr, stride_pt, seq_lens_ptr, first, second, block_lo, per_split,
                      B: tl.constexpr, LOCAL: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """1 if requests ``first`` and ``second`` scan the same pages in the split starting at ``block_lo`` (the same
    candidate range, not empty, the same page ids), else 0."""
    block_hi = _split_end(seq_lens_ptr, first, block_lo, per_split, B, LOCAL)
    same = (block_hi > block_lo) & (_split_end(seq_lens_ptr, second, block_lo, per_split, B, LOCAL) == block_hi)
    if same:
        first_row = page_table_ptr + first.to(tl.int64) * stride_pt
        second_row = page_table_ptr + second.to(tl.int64) * stride_pt
        offsets = tl.arange(0, CHUNK)
        for start in range(block_lo, block_hi, CHUNK):
            in_split = start + offsets < block_hi
            first_pages = tl.load(first_row + start + offsets, mask=in_split, other=0)
            second_pages = tl.load(second_row + start + offsets, mask=in_split, other=0)
            same = same & (tl.sum((first_pages != second_pages).to(tl.int32), axis=0) == 0)
    return same.to(tl.int32)


@triton.jit(do_not_specialize=["num_splits", "stride_pt", "store", "per_split"])
def _shared_scan_kernel(
    q_ptr, key_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, list_ptr, head_ptr,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_pt, num_splits, store, per_split,
    slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb, stride_ip, stride_ib,
    HIDX: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr, CS: tl.constexpr, KP: tl.constexpr,
    GROUP: tl.constexpr, LOCAL: tl.constexpr, PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, INPUT_PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    ST_HKV: tl.constexpr, ST_HKV_P: tl.constexpr, ST_D: tl.constexpr,
    ST_D_P: tl.constexpr, ST_DI: tl.constexpr, ST_DI_P: tl.constexpr, ST_HAS_INDEX: tl.constexpr,
):  # fmt: skip
    """``_scan_kernel`` (without the fused merge) over splits of ``per_split`` blocks in every request, where the
    program of the first request of a run of consecutive requests (within an aligned window of ``GROUP``) that
    scan the same pages in its split scans them for the whole run; the run's other programs only store.

    Column n is (request n // CS of the run, token (n % CS) // HIDX of it, index head n % HIDX); every run
    member's list for the split is written where its own program would have written it."""
    if SPLIT_MAJOR:
        request = tl.program_id(0)
        split = tl.program_id(1)
        num_requests = tl.num_programs(0)
    else:
        split = tl.program_id(0)
        request = tl.program_id(1)
        num_requests = tl.num_programs(1)
    if store != 0:  # noqa: SIM102
        if split == 0:
            store_token(
                tl.load(query_start_ptr + request), slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr,
                index_cache_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch,
                stride_cb, stride_ip, stride_ib, ST_HKV, ST_HKV_P, ST_D, ST_D_P, ST_DI, ST_DI_P, B, ST_HAS_INDEX,
            )  # fmt: skip
    block_lo = split * per_split
    window = (request // GROUP) * GROUP
    leads = 1
    if request > window:
        leads = 1 - _same_split_pages(page_table_ptr, stride_pt, seq_lens_ptr, request - 1, request, block_lo,
                                      per_split, B, LOCAL, CHUNK)  # fmt: skip
    if leads != 0:
        members = 1
        more = 1
        for m in tl.static_range(1, GROUP):
            if (more != 0) & (request + m < num_requests) & (request + m < window + GROUP):
                more = _same_split_pages(page_table_ptr, stride_pt, seq_lens_ptr, request + m - 1, request + m,
                                         block_lo, per_split, B, LOCAL, CHUNK)  # fmt: skip
            else:
                more = 0
            members += more
        cols = tl.arange(0, N)
        member = cols // CS
        in_run = member < members
        column_request = request + member
        q_start = tl.load(query_start_ptr + column_request, mask=in_run, other=0)
        q_len = tl.load(query_start_ptr + column_request + 1, mask=in_run, other=0) - q_start
        seq_len = tl.load(seq_lens_ptr + column_request, mask=in_run, other=1)
        column = cols % CS
        block_hi = _split_end(seq_lens_ptr, request, block_lo, per_split, B, LOCAL)
        page_row = page_table_ptr + request.to(tl.int64) * stride_pt
        top = _score_columns(q_ptr, key_ptr, page_row, q_start, q_len, seq_len, column, in_run, block_lo, block_hi,
                             stride_qt, stride_qh, stride_kp, stride_kb, HIDX, N, D, B, KP, LOCAL, PAGES,
                             PAGE_IDS_AHEAD, INPUT_PRECISION)  # fmt: skip
        rows = (column_request.to(tl.int64) * num_splits + split) * CS + column
        slots = tl.arange(0, KP)
        tl.store(list_ptr + rows[:, None] * KP + slots[None, :], top, mask=in_run[:, None])
        tl.store(head_ptr + rows, tl.max(top, axis=1), mask=in_run)


@triton.jit(do_not_specialize=["num_splits", "num_tokens", "stride_pt", "uniform_per_split"])
def _merge_kernel(
    list_ptr, head_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, row_indptr_ptr, selected_ptr, page_ids_ptr,
    stride_pt, num_splits, num_tokens, uniform_per_split,
    HIDX: tl.constexpr, B: tl.constexpr, CS: tl.constexpr, CPB: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr, LOCAL: tl.constexpr,
    FLOOR: tl.constexpr,
):  # fmt: skip
    """The merge as its own launch, grid ``(R, CS / CPB)``: one program per group of CPB columns.  A nonzero
    ``uniform_per_split`` is the split size the scan used for every request (``_shared_scan_kernel``)."""
    request = tl.program_id(0)
    q_start, q_len, seq_len, _, per_split = _request_span(query_start_ptr, seq_lens_ptr, request, num_splits, B,
                                                          LOCAL)  # fmt: skip
    if uniform_per_split > 0:
        per_split = uniform_per_split
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    _merge_columns(
        list_ptr, head_ptr, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr,
        request, q_start, q_len, seq_len, per_split, num_splits, num_tokens, tl.program_id(1) * CPB,
        HIDX, B, CS, CPB, KP, SP, TOPK, TOPK_P, KR, KR_P, LOCAL, FLOOR,
    )  # fmt: skip


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


@dataclass(frozen=True)
class NewKeys:
    """A decode step's new keys, for the scan to store into ``cache`` (``msa.store.store_kv``'s inputs)."""

    cache: LayerKVCache
    slot_mapping: torch.Tensor  # [T]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    index_k: torch.Tensor  # [T, d]


@dataclass(frozen=True)
class _MergeShape:
    """Host-side sizes of the lists and of the merge (constexprs of both kernels)."""

    columns_stored: int  # CS: (tokens x index heads) per request, padded to a power of two
    list_slots: int  # KP
    splits_padded: int  # SP
    columns_per_program: int  # CPB

    @property
    def fits_one_program(self) -> bool:
        return self.columns_per_program == self.columns_stored


def _list_slots(shape: SparseDecodeShape) -> int:
    """KP: the slots of a scan program's candidate list per column (the ranked blocks, to a power of two)."""
    return triton.next_power_of_2(max(shape.topk - shape.local_blocks, 1))


def _merge_shape(plan: SparseDecodePlan, warps: int) -> _MergeShape:
    shape = plan.shape
    columns = triton.next_power_of_2(max(shape.num_kv_heads * plan.max_query_len, _MIN_MERGE_COLUMNS))
    splits_padded = triton.next_power_of_2(plan.scan_splits)
    per_program = max(1, min(columns, _MERGE_KEYS_PER_WARP * warps // splits_padded))
    if per_program == 2:  # never a 2-column merge program (above): one column each instead
        per_program = 1
    return _MergeShape(columns, _list_slots(shape), splits_padded, per_program)


def _merge_constexprs(plan: SparseDecodePlan, merge: _MergeShape) -> dict[str, int]:
    shape = plan.shape
    ranked = max(shape.topk - shape.local_blocks, 1)
    return dict(
        HIDX=shape.num_kv_heads, B=shape.block_size, CS=merge.columns_stored, KP=merge.list_slots,
        SP=merge.splits_padded, TOPK=shape.topk, TOPK_P=triton.next_power_of_2(shape.topk), KR=ranked,
        KR_P=triton.next_power_of_2(ranked), LOCAL=shape.local_blocks, FLOOR=_FLOOR,
    )  # fmt: skip


def _store_constexprs(plan: SparseDecodePlan) -> dict[str, int | bool]:
    """``store_token``'s constexprs for an MSA layer of the plan's shape (its cache always has index keys)."""
    shape = plan.shape
    return dict(ST_HKV=shape.num_kv_heads, ST_HKV_P=triton.next_power_of_2(shape.num_kv_heads), ST_D=shape.head_dim,
                ST_D_P=triton.next_power_of_2(shape.head_dim), ST_DI=shape.index_head_dim,
                ST_DI_P=triton.next_power_of_2(shape.index_head_dim), ST_HAS_INDEX=True)  # fmt: skip


def _store_arguments(
    new_keys: NewKeys | None,
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    plan: SparseDecodePlan,
    metadata: AttentionMetadata,
) -> tuple[tuple, dict[str, int | bool]]:
    """The scan's store arguments: the real ones with ``new_keys``, else stand-ins of the same types and the same
    constexprs (the scan never reads them), so both cases share one compiled kernel."""
    if new_keys is None:
        stand_ins = (metadata.slot_mapping, index_q, index_q, index_q, index_q, index_q, index_key_cache)
        return stand_ins + (0,) * 10, _store_constexprs(plan)
    if not metadata.is_pure_decode:
        raise ValueError("the scan stores new keys only for decode steps of one token per request")
    check_store_inputs(new_keys.cache, new_keys.slot_mapping, new_keys.k, new_keys.v, new_keys.index_k)
    if new_keys.cache.index_key is None:
        raise ValueError("the scan stores into an MSA layer's cache (with index keys)")
    args, constexprs = store_launch_args(new_keys.cache, new_keys.slot_mapping, new_keys.k, new_keys.v,
                                         new_keys.index_k)  # fmt: skip
    if constexprs.pop("B") != plan.shape.block_size:
        raise ValueError("the cache's page size differs from the plan's block size")
    constexprs = {f"ST_{name}": value for name, value in constexprs.items()}
    if constexprs != _store_constexprs(plan):
        raise ValueError(f"the cache's shape {constexprs} differs from the plan's {_store_constexprs(plan)}")
    return args, constexprs


@dataclass
class IndexScan:
    """What ``scan_index_pages`` launched: the per-split lists, and the selection if already merged."""

    lists: torch.Tensor  # [R, splits, CS, KP] int64 packed candidates
    heads: torch.Tensor  # [R, splits, CS] int64, each list's best
    selected: torch.Tensor  # [Hidx, T, topk] int32, filled by the merge
    merged: bool  # the scan's last programs merged (one launch)
    merge: _MergeShape
    merge_warps: int
    uniform_per_split: int = 0  # blocks of every request's splits (shared-page scans), else 0: per request


def scan_index_pages(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
    new_keys: NewKeys | None = None,
) -> IndexScan:
    """Step 1 (and step 2 with ``config.fused_merge`` where the columns fit one program): the scan."""
    check_decode_inputs(index_q, index_key_cache, metadata, plan)
    if new_keys is not None and new_keys.cache.index_key is not index_key_cache:
        raise ValueError("new_keys.cache must be the cache whose index keys are scanned")
    config = config or ScanConfig()
    shape = plan.shape
    num_tokens, num_heads, head_dim = index_q.shape
    store_args, store_constexprs = _store_arguments(new_keys, index_q, index_key_cache, plan, metadata)
    merge_warps = _FUSED_MERGE_WARPS if config.fused_merge else config.merge_warps
    if _list_slots(shape) < _FEW_WARP_MERGE_MIN_SLOTS:
        merge_warps = _FUSED_MERGE_WARPS
    merge = _merge_shape(plan, merge_warps)
    splits = plan.scan_splits
    device = index_q.device
    scan = IndexScan(
        lists=torch.empty((plan.num_requests, splits, merge.columns_stored, merge.list_slots), dtype=torch.int64,
                          device=device),
        heads=torch.empty((plan.num_requests, splits, merge.columns_stored), dtype=torch.int64, device=device),
        selected=torch.empty((num_heads, num_tokens, shape.topk), dtype=torch.int32, device=device),
        merged=config.fused_merge and merge.fits_one_program and not config.shared_pages,
        merge=merge,
        merge_warps=merge_warps,
    )  # fmt: skip
    if plan.num_requests == 0:
        return scan
    grid = (plan.num_requests, splits) if config.split_major else (splits, plan.num_requests)
    common = dict(
        D=head_dim, PAGES=config.pages_per_iteration, PAGE_IDS_AHEAD=config.page_ids_ahead,
        SPLIT_MAJOR=config.split_major, INPUT_PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.shared_pages:
        # Splits sized from the page table's width (fixed for a captured graph), so every request's split s covers
        # the same blocks and one program can serve the requests that share them.
        scan.uniform_per_split = max(1, -(-max(0, metadata.page_table.shape[1] - shape.local_blocks) // splits))
        # Requests a program may serve: at most MAX_DECODE_COLUMNS columns in all, as the per-request scan.
        group = max(1, min(config.shared_group, MAX_DECODE_COLUMNS // merge.columns_stored))
        columns = max(16, merge.columns_stored * group)
        constexprs = _merge_constexprs(plan, merge)
        _shared_scan_kernel[grid](
            index_q, index_key_cache, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, scan.lists,
            scan.heads, index_q.stride(0), index_q.stride(1), index_key_cache.stride(0), index_key_cache.stride(1),
            metadata.page_table.stride(0), splits, int(new_keys is not None), scan.uniform_per_split,
            *store_args, HIDX=constexprs["HIDX"], B=constexprs["B"], LOCAL=constexprs["LOCAL"], N=columns,
            CS=merge.columns_stored, KP=merge.list_slots, GROUP=group, CHUNK=_PAGE_COMPARE_CHUNK, **common,
            **store_constexprs,
        )  # fmt: skip
        return scan
    _scan_kernel[grid](
        index_q, index_key_cache, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, scan.lists,
        scan.heads, plan.scan_counters, plan.row_indptr, scan.selected, plan.page_ids,
        index_q.stride(0), index_q.stride(1), index_key_cache.stride(0), index_key_cache.stride(1),
        metadata.page_table.stride(0), splits, num_tokens, int(new_keys is not None), *store_args,
        N=max(16, triton.next_power_of_2(num_heads * plan.max_query_len)), MERGE=scan.merged,
        **_merge_constexprs(plan, merge), **common, **store_constexprs,
    )  # fmt: skip
    return scan


def merge_selection(scan: IndexScan, metadata: AttentionMetadata, plan: SparseDecodePlan) -> torch.Tensor:
    """Step 2 unless the scan merged: fills ``plan.page_ids``; returns the block ids ``[Hidx, T, topk]``."""
    if scan.merged or plan.num_requests == 0:
        return scan.selected
    merge = scan.merge
    _merge_kernel[(plan.num_requests, merge.columns_stored // merge.columns_per_program)](
        scan.lists, scan.heads, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, plan.row_indptr,
        scan.selected, plan.page_ids, metadata.page_table.stride(0), plan.scan_splits, plan.num_tokens,
        scan.uniform_per_split, CPB=merge.columns_per_program, **_merge_constexprs(plan, merge),
        num_warps=scan.merge_warps,
    )  # fmt: skip
    return scan.selected


def decode_index_topk(
    index_q: torch.Tensor,
    index_key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    config: ScanConfig | None = None,
    new_keys: NewKeys | None = None,
) -> torch.Tensor:
    """Select every new token's blocks and write their virtual page ids into ``plan.page_ids``.

    ``index_q`` ``[T, Hidx, d]``: the indexer queries after norm and RoPE (Hidx = Hkv);
    ``index_key_cache`` ``[num_pages, B, d]`` holds the context's index keys: this step's too, unless
    ``new_keys`` (pure decode steps only) has the scan store them (and K and V) on the way.  Returns
    the logical block ids ``[Hidx, T, topk]`` int32 (layout of ``reference.index_block_topk``).
    """
    scan = scan_index_pages(index_q, index_key_cache, metadata, plan, config, new_keys)
    return merge_selection(scan, metadata, plan)
