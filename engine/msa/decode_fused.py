"""MSA decode attention that selects its own pages: the index merge fused into the sparse attention.

The decode layer is otherwise three dependent launches: the index scan, the merge of its per-split candidate
lists (``decode_index``), and the attention over the selected pages (``paged_attention``).  At batch 1 the merge
and the attention are latency, not bandwidth (a merge ranks a few hundred list heads; a row's attention reads 16
pages): ~6-10 us each after the scan on an H200, where the whole layer at 128K context takes ~30.

Here one launch follows the scan: program ``(row, split)`` (row = (token, KV head), whose index column is the
same (token, index head) since Hidx = Hkv) merges that column's lists itself (``decode_index_kernels.merged_blocks``,
the same ranking the merge launch runs, so the same blocks), attends the ``split``-th slice of the selected
pages, and the row's last program combines the slices (``paged_attention.finish_row``).  The merge is repeated
by every split of a row (from L2, in parallel) instead of run once before all of them.  Split 0 of each row
also writes the selection as the merge would (block ids and virtual page ids), for whatever reads it later.

With programmatic dependent launch (``ScanConfig.pdl``) the launch starts while the scan runs: its programs
load their queries, then wait for the scan's lists.
"""

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.msa.decode_attention import TritonDecodeConfig, check_sparse_decode_inputs
from m3stack.engine.msa.decode_index import IndexScan, merge_constexprs
from m3stack.engine.msa.decode_index_kernels import merged_blocks, request_span, store_selection
from m3stack.engine.msa.decode_plan import SparseDecodePlan
from m3stack.engine.msa.launch import pdl_launch
from m3stack.engine.msa.paged_attention import (
    LOG2E,
    attend_page,
    check_out,
    finish_row,
    load_row_queries,
    sparse_row,
    split_rows,
)


@triton.jit(do_not_specialize=["pages_per_split", "num_splits", "num_scan_splits", "uniform_per_split",
                               "num_tokens", "stride_pt"])  # fmt: skip
def _select_attend_kernel(
    q_ptr, key_ptr, value_ptr, out_ptr, partial_o_ptr, partial_lse_ptr, counter_ptr,
    list_ptr, head_ptr, page_table_ptr, query_start_ptr, seq_lens_ptr, token_request_ptr, row_indptr_ptr,
    last_len_ptr, selected_ptr, page_ids_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_kh, stride_kb, stride_pt,
    pages_per_split, num_splits, num_scan_splits, uniform_per_split, num_tokens, scale_log2,
    HIDX: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr, CS: tl.constexpr,
    KP: tl.constexpr, SP: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, KR: tl.constexpr,
    KR_P: tl.constexpr, LOCAL: tl.constexpr, FLOOR: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    token = row // HIDX
    head = row % HIDX
    request = tl.load(token_request_ptr + token)
    q_start, q_len, seq_len, _, per_split = request_span(query_start_ptr, seq_lens_ptr, request, num_scan_splits, B,
                                                         LOCAL)  # fmt: skip
    if uniform_per_split > 0:
        per_split = uniform_per_split
    _, num_pages, last_len = sparse_row(row_indptr_ptr, last_len_ptr, row)
    page_row = page_table_ptr + request.to(tl.int64) * stride_pt
    q = load_row_queries(q_ptr, row, stride_qt, stride_qh, HIDX, G, GP, D)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the scan's lists (and the new token's K and V it stored) from here on
    column = ((token - q_start) * HIDX + head) + tl.zeros([1], tl.int32)
    block, col_ok = merged_blocks(list_ptr, head_ptr, request, q_len, seq_len, per_split, num_scan_splits, column,
                                  HIDX, B, CS, KP, SP, TOPK, TOPK_P, KR, KR_P, LOCAL, FLOOR)  # fmt: skip
    if split == 0:
        store_selection(block, col_ok, column, page_row, row_indptr_ptr, selected_ptr, page_ids_ptr, q_start,
                        num_tokens, HIDX, TOPK, TOPK_P)  # fmt: skip
    slots = tl.arange(0, TOPK_P)[None, :]
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, num_pages)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.full([GP], 0, tl.float32)
    acc = tl.full([GP, D], 0, tl.float32)
    for j in range(lo, hi):
        block_j = tl.sum(tl.sum(tl.where(slots == j, block, 0), axis=1), axis=0)
        page = tl.load(page_row + block_j).to(tl.int64)
        num_keys = tl.where(j == num_pages - 1, last_len, B)
        m_i, l_i, acc = attend_page(q, key_ptr, value_ptr, page * stride_kp + head * stride_kh, num_keys, m_i, l_i,
                                    acc, stride_kb, scale_log2, D, B, INPUT_PRECISION)  # fmt: skip
    finish_row(m_i, l_i, acc, out_ptr, partial_o_ptr, partial_lse_ptr, counter_ptr, row, split, num_splits,
               stride_ot, stride_oh, HIDX, G, GP, D, SPLIT, True)  # fmt: skip


def select_and_attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scan: IndexScan,
    metadata: AttentionMetadata,
    plan: SparseDecodePlan,
    scale: float,
    config: TritonDecodeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each new token over the blocks the unmerged ``scan`` (``scan_index_pages`` with the merge not
    fused) selects for it: ``[T, Hq, D]`` in q's dtype.  Fills ``scan.selected`` and ``plan.page_ids`` as the merge
    would; the scan's programs per request and ``plan`` must be the ones the scan ran with."""
    check_sparse_decode_inputs(q, key_cache, value_cache, plan)
    if scan.merged:
        raise ValueError("the scan already merged its lists: attend with sparse_decode_attention")
    out = check_out(out, q)
    config = config or TritonDecodeConfig()
    shape = plan.shape
    num_rows = plan.num_rows
    if num_rows == 0:
        return out
    group = shape.num_q_heads // shape.num_kv_heads
    splits = split_rows(q, num_rows, group, plan.max_row_pages, config.pages_per_split)
    partial_o = out if splits.partial_o is None else splits.partial_o  # unused without splits
    partial_lse = out if splits.partial_lse is None else splits.partial_lse
    launch = dict(num_warps=config.num_warps)
    if config.num_stages is not None:
        launch["num_stages"] = config.num_stages
    constexprs = merge_constexprs(plan, scan.merge)
    _select_attend_kernel[(num_rows, splits.num_splits)](
        q, key_cache, value_cache, out, partial_o, partial_lse, plan.attention_counters,
        scan.lists, scan.heads, metadata.page_table, metadata.query_start_loc, metadata.seq_lens, plan.token_request,
        plan.row_indptr, plan.last_page_len, scan.selected, plan.page_ids,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), metadata.page_table.stride(0),
        splits.pages_per_split, splits.num_splits, plan.scan_splits, scan.uniform_per_split, plan.num_tokens,
        scale * LOG2E, G=group, GP=splits.group_padded, D=shape.head_dim, SPLIT=splits.split, PDL=scan.pdl,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **constexprs, **launch,
        **pdl_launch(scan.pdl),
    )  # fmt: skip
    return out
