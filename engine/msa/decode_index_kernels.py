"""The Triton kernels of the MSA decode indexer (``decode_index`` sizes and launches them; its docstring has the
algorithm): the scan (``scan_kernel``, and ``shared_scan_kernel`` for pages several requests share), the merge of the
per-split candidate lists (in the scan's last program of a request, or ``merge_kernel``), and the pieces the fused
decode (``decode_fused``) reuses (``request_span``, ``merged_blocks``, ``store_selection``).

A candidate is packed into one int64: its score's order-preserving bits high, its inverted block id low, so "higher
score, then lower block id" is one integer comparison.
"""

import triton
import triton.language as tl

from m3stack.engine.fp16_range import fp16_shift
from m3stack.engine.msa.store import store_token

# Below every packed key, real or empty (the merges' ``FLOOR`` constexpr).
FLOOR = -(2**63)


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
def request_span(query_start_ptr, seq_lens_ptr, request, num_splits, B: tl.constexpr, LOCAL: tl.constexpr):
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
def merged_blocks(
    list_ptr, head_ptr, request, q_len, seq_len, per_split, num_splits, cols,
    HIDX: tl.constexpr, B: tl.constexpr, CS: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr, LOCAL: tl.constexpr,
    FLOOR: tl.constexpr,
):  # fmt: skip
    """Final selection of the columns ``cols`` ``[C]`` of ``request`` from the scan's lists: ``[C, TOPK_P]`` logical
    block ids (ranked best first, then the local blocks, the token's own block last, then -1), and whether each
    column is one of the request's (token, index head) pairs.

    Lists ``[R, splits, CS, KP]`` and heads ``[R, splits, CS]`` were written by other programs of this launch or
    of an earlier one: they are read from L2 (``.cg``), never from a stale L1 line.
    """
    split_ids = tl.arange(0, SP)[None, :]
    first = request.to(tl.int64) * num_splits
    heads = tl.load(head_ptr + (first + split_ids) * CS + cols[:, None], mask=split_ids < num_splits, other=FLOOR,
                    cache_modifier=".cg")  # fmt: skip
    # Only lists whose head ranks among the best KR heads can hold a selected block.
    best_heads = _take_best(heads, KR, KR_P, FLOOR)  # [C, KR_P]
    owner = _unpack_block(best_heads) // tl.maximum(per_split, 1)  # empty / FLOOR heads: past every split
    owned = owner < num_splits
    slots = tl.arange(0, KP)[None, None, :]
    lists = tl.load(
        list_ptr + ((first + owner[:, :, None]) * CS + cols[:, None, None]) * KP + slots,
        mask=owned[:, :, None], other=FLOOR, cache_modifier=".cg",
    )  # [C, KR_P, KP]  # fmt: skip
    picked = _take_best(tl.reshape(lists, [cols.shape[0], KR_P * KP]), KR, TOPK_P, FLOOR)  # [C, TOPK_P]

    # Column c is (token c // HIDX of the request, index head c % HIDX).
    token_in_request = cols // HIDX
    q_block = (seq_len - q_len + token_in_request) // B
    num_local = tl.minimum(q_block + 1, LOCAL)
    first_local = q_block + 1 - num_local
    num_ranked = tl.minimum(TOPK - num_local, first_local)  # at most KR
    out = tl.arange(0, TOPK_P)[None, :]
    is_ranked = out < num_ranked[:, None]
    is_local = (out >= num_ranked[:, None]) & (out < (num_ranked + num_local)[:, None])
    block = tl.where(is_ranked, _unpack_block(picked),
                     tl.where(is_local, first_local[:, None] + out - num_ranked[:, None], -1))  # fmt: skip
    return block, token_in_request < q_len


@triton.jit
def store_selection(
    block, col_ok, cols, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr, q_start, num_tokens,
    HIDX: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
):  # fmt: skip
    """Write ``merged_blocks``' selection twice: block ids ``[Hidx, T, topk]`` and the rows' virtual page ids."""
    token = q_start + cols // HIDX
    head = cols % HIDX
    out = tl.arange(0, TOPK_P)[None, :]
    keep = col_ok[:, None] & (out < TOPK)
    tl.store(selected_ptr + (head * num_tokens + token)[:, None].to(tl.int64) * TOPK + out, block, mask=keep)
    valid = keep & (block >= 0)
    page = tl.load(page_row + block, mask=valid, other=0)
    row_start = tl.load(row_indptr_ptr + token * HIDX + head, mask=col_ok, other=0)
    tl.store(page_ids_ptr + row_start[:, None] + out, page * HIDX + head[:, None], mask=valid)


@triton.jit
def _merge_columns(
    list_ptr, head_ptr, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr,
    request, q_start, q_len, seq_len, per_split, num_splits, num_tokens, col_lo,
    HIDX: tl.constexpr, B: tl.constexpr, CS: tl.constexpr, CPB: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr,
    LOCAL: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    """Merge and store columns ``col_lo .. col_lo + CPB - 1`` of ``request``."""
    cols = col_lo + tl.arange(0, CPB)
    block, col_ok = merged_blocks(list_ptr, head_ptr, request, q_len, seq_len, per_split, num_splits, cols,
                                  HIDX, B, CS, KP, SP, TOPK, TOPK_P, KR, KR_P, LOCAL, FLOOR)  # fmt: skip
    store_selection(block, col_ok, cols, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr, q_start, num_tokens,
                    HIDX, TOPK, TOPK_P)  # fmt: skip


@triton.jit
def _row_pages(page_row, first, block_hi, page_of_row, PAGES: tl.constexpr, B: tl.constexpr):
    """The page of each row of the key tile of blocks ``first .. first + PAGES - 1`` (0 past ``block_hi``)."""
    row_page = tl.full([PAGES * B], 0, tl.int64)
    for p in tl.static_range(PAGES):
        page = tl.load(page_row + first + p, mask=first + p < block_hi, other=0).to(tl.int64)
        row_page = tl.where(page_of_row == p, page, row_page)
    return row_page


@triton.jit
def _fp16_columns(q):
    """The queries ``q`` ``[D, N]`` (bf16) in fp16, each column times a power of two from its largest magnitude
    (``fp16_shift``).  A column's scores come out times its power of two, which changes no ranking: each column
    ranks its own blocks only, with the same factor in every split."""
    q = q.to(tl.float32)
    down, _ = fp16_shift(tl.max(tl.abs(q), axis=0))
    return (q * down[None, :]).to(tl.float16)


@triton.jit
def _scan_pages(
    q, key_ptr, key_scale_ptr, page_row, block_lo, block_hi, column_limit, stride_kp, stride_kb, stride_ksp,
    N: tl.constexpr, D: tl.constexpr, B: tl.constexpr, KP: tl.constexpr, PAGES: tl.constexpr,
    PAGE_IDS_AHEAD: tl.constexpr, INPUT_PRECISION: tl.constexpr, KEY_SCALED: tl.constexpr,
):  # fmt: skip
    """The running top-K ``[N, KP]`` of blocks ``block_lo .. block_hi - 1`` of one page-table row, scored
    against the queries ``q`` ``[D, N]`` (block max); column n ranks only blocks below ``column_limit[n]``.
    ``KEY_SCALED``: each stored key is ``key / scale`` with a float32 scale per token (fp8 k-index), whose score
    is scaled back before the block max."""
    dims = tl.arange(0, D)
    # An fp8 k-index against bf16 queries multiplies in fp16: e4m3 widens to fp16 in one instruction a pair, where
    # bf16 needs a second conversion after it, and the queries (fp16 once a column, a power of two from their
    # largest magnitude: _fp16_columns) lose nothing a bf16 product kept.
    FP16_SCAN: tl.constexpr = key_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16
    if FP16_SCAN:
        q = _fp16_columns(q)
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
        if KEY_SCALED:
            scale = tl.load(key_scale_ptr + row_page * stride_ksp + row_in_page, mask=first + page_of_row < block_hi,
                            other=0.0)  # fmt: skip
            scores = scores * scale[:, None]
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
    q_ptr, key_ptr, key_scale_ptr, page_row, q_start, q_len, seq_len, column, in_use, block_lo, block_hi,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_ksp,
    HIDX: tl.constexpr, N: tl.constexpr, D: tl.constexpr, B: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr,
    PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr, INPUT_PRECISION: tl.constexpr, KEY_SCALED: tl.constexpr,
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
    return _scan_pages(q, key_ptr, key_scale_ptr, page_row, block_lo, block_hi, tl.minimum(first_local, block_hi),
                       stride_kp, stride_kb, stride_ksp, N, D, B, KP, PAGES, PAGE_IDS_AHEAD, INPUT_PRECISION,
                       KEY_SCALED)  # fmt: skip


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
# Whether the step's keys are stored here is a runtime flag too, with stand-in store arguments of the same types
# and constexprs otherwise: the CUDA graphs capture pure decode steps (storing), and a mixed step run eagerly
# later (not storing) must find the same compiled kernel rather than compile its own variant mid-serving.
@triton.jit(do_not_specialize=["num_splits", "num_tokens", "stride_pt", "store"])
def scan_kernel(
    q_ptr, key_ptr, key_scale_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, list_ptr, head_ptr, counter_ptr,
    row_indptr_ptr, selected_ptr, page_ids_ptr,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_ksp, stride_pt, num_splits, num_tokens, store,
    # msa.store.store_token's arguments (read only when store is nonzero)
    slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr, index_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb, stride_ip, stride_ib,
    stride_sp,
    HIDX: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr, CS: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr,
    LOCAL: tl.constexpr, PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr, SPLIT_MAJOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr, KEY_SCALED: tl.constexpr,
    FLOOR: tl.constexpr, ST_HKV: tl.constexpr, ST_HKV_P: tl.constexpr, ST_D: tl.constexpr,
    ST_D_P: tl.constexpr, ST_DI: tl.constexpr, ST_DI_P: tl.constexpr, ST_HAS_INDEX: tl.constexpr,
    ST_INDEX_SCALED: tl.constexpr,
):  # fmt: skip
    if SPLIT_MAJOR:
        request = tl.program_id(0)
        split = tl.program_id(1)
    else:
        split = tl.program_id(0)
        request = tl.program_id(1)
    if PDL:
        # The next launch (merge or attention, launched with PDL) may start now: its programs load what they can
        # and wait for this grid's completion (``gdc_wait``) before reading anything it writes.
        tl.extra.cuda.gdc_launch_dependents()
    q_start, q_len, seq_len, num_candidates, per_split = request_span(query_start_ptr, seq_lens_ptr, request,
                                                                       num_splits, B, LOCAL)  # fmt: skip
    if store != 0:  # noqa: SIM102
        if split == 0:
            # The request's one new token (the host checks) lands in its last block: local, never scanned.
            store_token(
                q_start, slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr,
                index_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch,
                stride_cb, stride_ip, stride_ib, stride_sp, ST_HKV, ST_HKV_P, ST_D, ST_D_P, ST_DI, ST_DI_P, B,
                ST_HAS_INDEX, ST_INDEX_SCALED,
            )  # fmt: skip

    # Column n is (token n // HIDX of the request, index head n % HIDX).
    cols = tl.arange(0, N)
    block_lo = split * per_split
    block_hi = tl.minimum(block_lo + per_split, num_candidates)
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    top = _score_columns(q_ptr, key_ptr, key_scale_ptr, page_row, q_start, q_len, seq_len, cols, cols < N, block_lo,
                         block_hi, stride_qt, stride_qh, stride_kp, stride_kb, stride_ksp, HIDX, N, D, B, KP, LOCAL,
                         PAGES, PAGE_IDS_AHEAD, INPUT_PRECISION, KEY_SCALED)  # fmt: skip
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
def shared_scan_kernel(
    q_ptr, key_ptr, key_scale_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, list_ptr, head_ptr,
    stride_qt, stride_qh, stride_kp, stride_kb, stride_ksp, stride_pt, num_splits, store, per_split,
    slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr, index_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb, stride_ip, stride_ib,
    stride_sp,
    HIDX: tl.constexpr, D: tl.constexpr, B: tl.constexpr, N: tl.constexpr, CS: tl.constexpr, KP: tl.constexpr,
    GROUP: tl.constexpr, LOCAL: tl.constexpr, PAGES: tl.constexpr, PAGE_IDS_AHEAD: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, INPUT_PRECISION: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
    KEY_SCALED: tl.constexpr,
    ST_HKV: tl.constexpr, ST_HKV_P: tl.constexpr, ST_D: tl.constexpr,
    ST_D_P: tl.constexpr, ST_DI: tl.constexpr, ST_DI_P: tl.constexpr, ST_HAS_INDEX: tl.constexpr,
    ST_INDEX_SCALED: tl.constexpr,
):  # fmt: skip
    """``scan_kernel`` (without the fused merge) over splits of ``per_split`` blocks in every request, where the
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
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if store != 0:  # noqa: SIM102
        if split == 0:
            store_token(
                tl.load(query_start_ptr + request), slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr,
                index_cache_ptr, index_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp,
                stride_ch, stride_cb, stride_ip, stride_ib, stride_sp, ST_HKV, ST_HKV_P, ST_D, ST_D_P, ST_DI,
                ST_DI_P, B, ST_HAS_INDEX, ST_INDEX_SCALED,
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
        top = _score_columns(q_ptr, key_ptr, key_scale_ptr, page_row, q_start, q_len, seq_len, column, in_run,
                             block_lo, block_hi, stride_qt, stride_qh, stride_kp, stride_kb, stride_ksp, HIDX, N, D, B,
                             KP, LOCAL, PAGES, PAGE_IDS_AHEAD, INPUT_PRECISION, KEY_SCALED)  # fmt: skip
        rows = (column_request.to(tl.int64) * num_splits + split) * CS + column
        slots = tl.arange(0, KP)
        tl.store(list_ptr + rows[:, None] * KP + slots[None, :], top, mask=in_run[:, None])
        tl.store(head_ptr + rows, tl.max(top, axis=1), mask=in_run)


@triton.jit(do_not_specialize=["num_splits", "num_tokens", "stride_pt", "uniform_per_split"])
def merge_kernel(
    list_ptr, head_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, row_indptr_ptr, selected_ptr, page_ids_ptr,
    stride_pt, num_splits, num_tokens, uniform_per_split,
    HIDX: tl.constexpr, B: tl.constexpr, CS: tl.constexpr, CPB: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr, KR_P: tl.constexpr, LOCAL: tl.constexpr,
    FLOOR: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The merge as its own launch, grid ``(R, CS / CPB)``: one program per group of CPB columns.  A nonzero
    ``uniform_per_split`` is the split size the scan used for every request (``shared_scan_kernel``).  With
    ``PDL`` it is launched while the scan runs and waits for it after reading the step's lengths."""
    request = tl.program_id(0)
    q_start, q_len, seq_len, _, per_split = request_span(query_start_ptr, seq_lens_ptr, request, num_splits, B,
                                                         LOCAL)  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if uniform_per_split > 0:
        per_split = uniform_per_split
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    _merge_columns(
        list_ptr, head_ptr, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr,
        request, q_start, q_len, seq_len, per_split, num_splits, num_tokens, tl.program_id(1) * CPB,
        HIDX, B, CS, CPB, KP, SP, TOPK, TOPK_P, KR, KR_P, LOCAL, FLOOR,
    )  # fmt: skip
