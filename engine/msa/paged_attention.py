"""Split-K attention over paged KV lists in Triton: the fallback where FlashInfer is absent (CPU
interpretation in CI, GPUs FlashInfer does not serve), for MSA decode and for dense layers.

Rows are ``r = t * Hkv + h`` (token, KV head); a row's ``G = Hq / Hkv`` query heads share its
pages, so they form the MMA M dimension.  A row attends a list of pages whose last one is
partial (``last_len`` keys); every other page is full.  Two ways to name the pages:

* sparse (MSA): ``page_ids[row_indptr[r] : row_indptr[r + 1]]``, virtual ids ``page * Hkv + h``
  written by the decode indexer (``decode_plan``), ``last_len`` per row;
* dense: pages ``0 .. position // B`` of the token's request through ``page_table``, ``last_len =
  position % B + 1`` (causal attention over everything cached).

Program ``(r, s)`` attends the ``s``-th slice of row ``r``'s pages with an online softmax; with
several slices, each writes a partial output and log-sum-exp, and either the last of the row's
programs to finish combines them (``counters``: a per-row atomic ticket, reset by that program, so
one launch) or ``_merge_kernel`` does in a second launch.

Slices are the same size for every row (by default sized so the step fills the GPU), or, with ``row_slices``,
cut from each row's own page count: then a row's slices, and so its output to the last bit, do not depend on
the other rows of the step nor on the page table's width.  In half precision the slicing shows in the result
(each slice rounds its softmax weights to the cache's dtype against its own running maximum), so decode steps,
which CUDA graphs replay padded and over the full-width table, use ``row_slices``: a replay gives the eager
step's tokens (``DECODE_ROW_SLICES``).
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.tensors import FP8_KV_DTYPE
from m3stack.engine.msa.launch import multiprocessors, pdl_available, pdl_launch
from m3stack.engine.msa.prefill_common import LOG2E

# Attention programs per SM to aim for when splitting rows over their pages.
_PROGRAMS_PER_SM = 2
# Decode rows sliced by their own length: at most this many slices a row, each of at least DECODE_SLICE_KEYS keys
# (rounded down to whole pages).  The partials are bounded by the slices (M3: 64 x 8 KiB a row); a slice's 256
# keys read 32-128 KiB of K and V against its 8 KiB partial; a single long row still spreads over 64 programs.
DECODE_ROW_SLICES = 64
DECODE_SLICE_KEYS = 256


def decode_slicing(block_size: int) -> tuple[int, int]:
    """``(pages_per_split, row_slices)`` for ``paged_attention`` over decode rows of ``block_size``-key pages."""
    return max(1, DECODE_SLICE_KEYS // block_size), DECODE_ROW_SLICES


@dataclass(frozen=True)
class PageRows:
    """How each row finds its pages (see the module docstring); tensors live on the device."""

    token_request: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [R, max_pages] int32 (dense rows)
    row_indptr: torch.Tensor | None  # [rows + 1] int32 (sparse rows), None for dense rows
    page_ids: torch.Tensor | None  # virtual page ids (sparse rows)
    last_len: torch.Tensor | None  # [rows] int32 (sparse rows)
    max_pages: int  # most pages of any row (host-known)

    @property
    def dense(self) -> bool:
        return self.row_indptr is None


@triton.jit
def attend_page(
    q, key_ptr, value_ptr, tile, num_keys, m_i, l_i, acc, stride_kb, scale_log2,
    D: tl.constexpr, B: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold the first ``num_keys`` keys of the ``[B, D]`` K/V tile at offset ``tile`` into the online softmax
    ``(m_i, l_i, acc)`` of the query heads ``q`` ``[GP, D]`` (log2 units)."""
    dims = tl.arange(0, D)
    keys_in_page = tl.arange(0, B)
    key_ok = keys_in_page < num_keys
    offsets = tile + keys_in_page[:, None] * stride_kb + dims[None, :]
    k = tl.load(key_ptr + offsets, mask=key_ok[:, None], other=0.0)
    v = tl.load(value_ptr + offsets, mask=key_ok[:, None], other=0.0)
    if k.dtype == tl.float8e4nv:  # an fp8 KV cache, widened exactly (through fp16, see msa.decode_index)
        k = k.to(tl.float16).to(q.dtype)
        v = v.to(tl.float16).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [GP, B], log2 units
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_row(
    m_i, l_i, acc, out_ptr, partial_o_ptr, partial_lse_ptr, counter_ptr, row, split, num_splits,
    stride_ot, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
    COMBINE: tl.constexpr,
):  # fmt: skip
    """A row's (or row slice's) end: the output, or with ``SPLIT`` the slice's partial output and LSE, combined by
    the row's last program when ``COMBINE`` (else by ``_merge_kernel``)."""
    token = row // HKV
    groups = tl.arange(0, GP)
    dims = tl.arange(0, D)
    q_heads = (row % HKV) * G + groups
    if SPLIT:
        # An empty slice (a short row) contributes nothing: lse -inf, output 0.
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        base = (row * num_splits + split).to(tl.int64) * GP
        tl.store(partial_o_ptr + (base + groups[:, None]) * D + dims[None, :], out)
        tl.store(partial_lse_ptr + base + groups, lse)
        if COMBINE:
            # Every thread's partial is stored before the ticket; acq_rel makes them visible to the
            # program that draws the row's last ticket, and every other program's to it.
            tl.debug_barrier()
            ticket = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                tl.store(counter_ptr + row, 0)  # the row's other programs are done: ready for the next launch
                _combine_row(out_ptr, partial_o_ptr, partial_lse_ptr, row, num_splits, stride_ot, stride_oh,
                             HKV, G, GP, D)  # fmt: skip
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(groups < G)[:, None])  # fmt: skip


@triton.jit
def sparse_row(row_indptr_ptr, last_len_ptr, row):
    """A sparse row's page list: where it starts in the page ids, its length, the keys of its last (own) page."""
    list_start = tl.load(row_indptr_ptr + row)
    return list_start, tl.load(row_indptr_ptr + row + 1) - list_start, tl.load(last_len_ptr + row)


@triton.jit
def load_row_queries(q_ptr, row, stride_qt, stride_qh, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                     D: tl.constexpr):  # fmt: skip
    """The ``G`` query heads of row ``row`` (token, KV head) as ``[GP, D]`` (zero padding rows)."""
    groups = tl.arange(0, GP)
    dims = tl.arange(0, D)
    q_heads = (row % HKV) * G + groups
    return tl.load(q_ptr + (row // HKV).to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + dims[None, :],
                   mask=(groups < G)[:, None], other=0.0)  # fmt: skip


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
@triton.jit(do_not_specialize=["pages_per_split", "row_slices", "num_splits", "stride_pt"])
def _attention_kernel(
    q_ptr, key_ptr, value_ptr, out_ptr, partial_o_ptr, partial_lse_ptr,
    token_request_ptr, positions_ptr, page_table_ptr, row_indptr_ptr, page_ids_ptr, last_len_ptr, counter_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_kh, stride_kb, stride_pt,
    pages_per_split, row_slices, num_splits, scale_log2,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
    DENSE: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    token = row // HKV
    head = row % HKV
    if DENSE:
        position = tl.load(positions_ptr + token)
        num_pages = (position // B + 1).to(tl.int32)
        last_len = (position % B + 1).to(tl.int32)
        list_start = 0
    else:
        list_start, num_pages, last_len = sparse_row(row_indptr_ptr, last_len_ptr, row)
    page_row = page_table_ptr + tl.load(token_request_ptr + token).to(tl.int64) * stride_pt
    if row_slices > 0:  # slices cut from this row's own pages (at least pages_per_split each)
        pages_per_split = tl.maximum(pages_per_split, tl.cdiv(num_pages, row_slices))
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, num_pages)
    q = load_row_queries(q_ptr, row, stride_qt, stride_qh, HKV, G, GP, D)
    if PDL:
        # Launched while the indexer runs: the page ids (and, in pure decode, the new token's K and V, which the
        # scan stores) are read only once it has finished.
        tl.extra.cuda.gdc_wait()
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.full([GP], 0, tl.float32)
    acc = tl.full([GP, D], 0, tl.float32)
    for j in range(lo, hi):
        if DENSE:
            tile = tl.load(page_row + j).to(tl.int64) * stride_kp + head * stride_kh
        else:
            virtual = tl.load(page_ids_ptr + list_start + j).to(tl.int64)
            tile = (virtual // HKV) * stride_kp + (virtual % HKV) * stride_kh
        num_keys = tl.where(j == num_pages - 1, last_len, B)
        m_i, l_i, acc = attend_page(q, key_ptr, value_ptr, tile, num_keys, m_i, l_i, acc, stride_kb, scale_log2,
                                    D, B, INPUT_PRECISION)  # fmt: skip
    finish_row(m_i, l_i, acc, out_ptr, partial_o_ptr, partial_lse_ptr, counter_ptr, row, split, num_splits,
               stride_ot, stride_oh, HKV, G, GP, D, SPLIT, COMBINE)  # fmt: skip


@triton.jit
def _combine_row(
    out_ptr, partial_o_ptr, partial_lse_ptr, row, num_splits, stride_ot, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s output from its splits' partials (read from L2: other programs wrote them)."""
    token = row // HKV
    head = row % HKV
    groups = tl.arange(0, GP)
    dims = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.full([GP], 0, tl.float32)
    acc = tl.full([GP, D], 0, tl.float32)
    for split in range(num_splits):
        base = (row * num_splits + split).to(tl.int64) * GP
        lse = tl.load(partial_lse_ptr + base + groups, cache_modifier=".cg")
        o = tl.load(partial_o_ptr + (base + groups[:, None]) * D + dims[None, :], cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        # Guard -inf - -inf while every slice so far was empty.
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp2(m - m_new))
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_new))
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    out = acc / total[:, None]
    q_heads = head * G + groups
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(groups < G)[:, None])  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr, partial_o_ptr, partial_lse_ptr, stride_ot, stride_oh, num_splits,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    _combine_row(out_ptr, partial_o_ptr, partial_lse_ptr, tl.program_id(0), num_splits, stride_ot, stride_oh,
                 HKV, G, GP, D)  # fmt: skip


def check_paged_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if q.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and the caches [pages, Hkv, B, D]; got {tuple(q.shape)}, "
                         f"{tuple(key_cache.shape)}")  # fmt: skip
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have the same shape and strides")
    num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {num_kv_heads} KV heads of dim {head_dim}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension")
    if key_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"q is {q.dtype} but the cache is {key_cache.dtype}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """A caller-owned output buffer must look like ``q``; without one, a fresh tensor."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device} with a contiguous last dim")
    return out


@dataclass(frozen=True)
class RowSplits:
    """How the rows' pages are split over programs, and the partials the splits write."""

    pages_per_split: int
    num_splits: int
    group_padded: int  # GP: the query heads of a row, padded to the MMA's minimum
    partial_o: torch.Tensor | None  # [rows, splits, GP, D] float32, with several splits
    partial_lse: torch.Tensor | None  # [rows, splits, GP] float32

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def split_rows(
    q: torch.Tensor, num_rows: int, group: int, max_pages: int, pages_per_split: int | None, row_slices: int = 0
) -> RowSplits:
    """``pages_per_split`` (None: ~``_PROGRAMS_PER_SM`` programs per SM over all rows' pages) and the partials.

    ``row_slices`` > 0: each row's pages in at most that many slices of at least ``pages_per_split`` (None: 1)
    pages, cut from the row's own page count in the kernel; the grid covers the widest row's."""
    if row_slices > 0:
        pages_per_split = pages_per_split or 1
        num_splits = max(1, min(row_slices, math.ceil(max_pages / pages_per_split)))
    else:
        if pages_per_split is None:
            target = _PROGRAMS_PER_SM * multiprocessors(q.device)
            pages_per_split = max(1, math.ceil(num_rows * max_pages / target))
        num_splits = max(1, math.ceil(max_pages / pages_per_split))
    group_padded = max(16, triton.next_power_of_2(group))
    if num_splits == 1:
        return RowSplits(pages_per_split, 1, group_padded, None, None)
    head_dim = q.shape[-1]
    partial_o = torch.empty((num_rows, num_splits, group_padded, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_rows, num_splits, group_padded), dtype=torch.float32, device=q.device)
    return RowSplits(pages_per_split, num_splits, group_padded, partial_o, partial_lse)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: PageRows,
    scale: float,
    pages_per_split: int | None = None,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    num_stages: int | None = None,
    pdl: bool = False,
    row_slices: int = 0,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, Hq, D]`` over each row's pages of the HND caches; ``[T, Hq, D]`` in q's
    dtype, written into ``out`` when given.  With ``counters`` (``[T * Hkv]`` int32, zero, left zero),
    split rows are combined inside the same launch.  ``pdl``: launched with programmatic dependent launch (where
    ``launch.pdl_available``), reading the page ids only once the launch before it has finished.  ``row_slices``
    > 0: each row sliced by its own length (``split_rows``; the module docstring says why)."""
    check_paged_inputs(q, key_cache, value_cache)
    out = check_out(out, q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return out
    splits = split_rows(q, num_rows, group, rows.max_pages, pages_per_split, row_slices)
    partial_o = out if splits.partial_o is None else splits.partial_o  # unused without splits
    partial_lse = out if splits.partial_lse is None else splits.partial_lse
    dense = rows.dense
    row_indptr = rows.page_table if dense else rows.row_indptr  # placeholders keep one signature
    page_ids = rows.page_table if dense else rows.page_ids
    last_len = rows.page_table if dense else rows.last_len
    combine = splits.split and counters is not None
    if combine and (counters.numel() < num_rows or counters.dtype != torch.int32):
        raise ValueError(f"counters must be int32 with at least {num_rows} entries")
    shapes = dict(HKV=num_kv_heads, G=group, GP=splits.group_padded, D=head_dim)
    launch = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    pdl = pdl and pdl_available(q.device)
    _attention_kernel[(num_rows, splits.num_splits)](
        q, key_cache, value_cache, out, partial_o, partial_lse,
        rows.token_request, rows.positions, rows.page_table, row_indptr, page_ids, last_len,
        counters if combine else rows.page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), rows.page_table.stride(0),
        splits.pages_per_split, row_slices, splits.num_splits, scale * LOG2E,
        B=block_size, DENSE=dense, SPLIT=splits.split, COMBINE=combine,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl, **launch, **shapes,
        **pdl_launch(pdl),
    )  # fmt: skip
    if splits.split and not combine:
        _merge_kernel[(num_rows,)](
            out, partial_o, partial_lse, out.stride(0), out.stride(1), splits.num_splits, num_warps=4, **shapes
        )
    return out
