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
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.msa.launch import multiprocessors

_LOG2E = 1.4426950408889634
# Attention programs per SM to aim for when splitting rows over their pages.
_PROGRAMS_PER_SM = 2


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


# Counts and widths that change from step to step stay unspecialized: Triton would otherwise compile a
# variant per value class (1, multiples of 16, others) the first time a step meets it, mid-serving.
@triton.jit(do_not_specialize=["pages_per_split", "num_splits", "stride_pt"])
def _attention_kernel(
    q_ptr, key_ptr, value_ptr, out_ptr, partial_o_ptr, partial_lse_ptr,
    token_request_ptr, positions_ptr, page_table_ptr, row_indptr_ptr, page_ids_ptr, last_len_ptr, counter_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_kh, stride_kb, stride_pt,
    pages_per_split, num_splits, scale_log2,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
    DENSE: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
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
        list_start = tl.load(row_indptr_ptr + row)
        num_pages = tl.load(row_indptr_ptr + row + 1) - list_start
        last_len = tl.load(last_len_ptr + row)
    page_row = page_table_ptr + tl.load(token_request_ptr + token).to(tl.int64) * stride_pt
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, num_pages)

    groups = tl.arange(0, GP)
    dims = tl.arange(0, D)
    keys_in_page = tl.arange(0, B)
    q_heads = head * G + groups
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + dims[None, :],
                mask=(groups < G)[:, None], other=0.0)  # fmt: skip
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
        key_ok = keys_in_page < num_keys
        offsets = tile + keys_in_page[:, None] * stride_kb + dims[None, :]
        k = tl.load(key_ptr + offsets, mask=key_ok[:, None], other=0.0)
        v = tl.load(value_ptr + offsets, mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [GP, B], log2 units
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
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
    if q.dtype != key_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {key_cache.dtype}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """A caller-owned output buffer must look like ``q``; without one, a fresh tensor."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device} with a contiguous last dim")
    return out


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
) -> torch.Tensor:
    """Attention of ``q`` ``[T, Hq, D]`` over each row's pages of the HND caches; ``[T, Hq, D]`` in q's
    dtype, written into ``out`` when given.  With ``counters`` (``[T * Hkv]`` int32, zero, left zero),
    split rows are combined inside the same launch."""
    check_paged_inputs(q, key_cache, value_cache)
    out = check_out(out, q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return out
    if pages_per_split is None:
        target = _PROGRAMS_PER_SM * multiprocessors(q.device)
        pages_per_split = max(1, math.ceil(num_rows * rows.max_pages / target))
    num_splits = max(1, math.ceil(rows.max_pages / pages_per_split))
    group_padded = max(16, triton.next_power_of_2(group))
    split = num_splits > 1
    if split:
        partial_o = torch.empty((num_rows, num_splits, group_padded, head_dim), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((num_rows, num_splits, group_padded), dtype=torch.float32, device=q.device)
    else:
        partial_o = partial_lse = out  # unused
    dense = rows.dense
    row_indptr = rows.page_table if dense else rows.row_indptr  # placeholders keep one signature
    page_ids = rows.page_table if dense else rows.page_ids
    last_len = rows.page_table if dense else rows.last_len
    combine = split and counters is not None
    if combine and (counters.numel() < num_rows or counters.dtype != torch.int32):
        raise ValueError(f"counters must be int32 with at least {num_rows} entries")
    shapes = dict(HKV=num_kv_heads, G=group, GP=group_padded, D=head_dim)
    launch = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    _attention_kernel[(num_rows, num_splits)](
        q, key_cache, value_cache, out, partial_o, partial_lse,
        rows.token_request, rows.positions, rows.page_table, row_indptr, page_ids, last_len,
        counters if combine else rows.page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), rows.page_table.stride(0),
        pages_per_split, num_splits, scale * _LOG2E,
        B=block_size, DENSE=dense, SPLIT=split, COMBINE=combine,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch, **shapes,
    )  # fmt: skip
    if split and not combine:
        _merge_kernel[(num_rows,)](
            out, partial_o, partial_lse, out.stride(0), out.stride(1), num_splits, num_warps=4, **shapes
        )
    return out
