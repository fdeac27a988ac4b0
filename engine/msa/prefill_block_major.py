"""KV-block-major sparse prefill (docs/msa.md#prefill-kernels): one program per (KV head, selected block)
work item, then an LSE merge per (token, KV head).

A work item (``prefill_csr``) is a run of at most ``queries_per_item`` queries that picked one
(KV head, block).  Its program loads the block's K and V once and loops over tiles of those
queries, ``TILE`` tokens x G query heads packed into the MMA M dimension; each row's softmax over
the block's keys is complete in one step (no rescaling loop), written as a normalised partial
output in q's dtype plus its base-2 LSE.  Only the query's own block can be partially visible, so
the causal mask is applied only to tiles that reach past the block's last key.  The merge kernel
combines each token's <= K partials per query head, reading every partial once.

Traffic per (token, KV head, selected block): q rows read (G x D), partial written and read back
(G x D each), so ~3 x G x D x itemsize bytes against 4 x G x B x D FLOPs: the partials, not the
MMAs, bound this kernel pair (docs/msa.md#performance-targets).  Tokens run in chunks so the partials stay bounded.

Latency is what a tile would wait on: its q rows are a gather through the CSR entries.  The
entries are loaded one tile ahead.  By default (``PREFETCH``) the next tile's q rows and positions
are then gathered into registers before this tile's MMAs and land while it computes; otherwise the
gather's addresses come from the previous iteration, so Triton's software pipeliner can stage it in
shared memory ``num_stages - 1`` tiles early (with the entries loaded in the same iteration the
gather is a second indirection level, which Triton 3.6 issues only right before its wait).
"""

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.msa.prefill_common import LOG2E, NEG_INF, PrefillTuning, load_kv_block, padded_dims
from m3stack.engine.msa.prefill_csr import (
    ITEM_END,
    ITEM_FIELDS,
    ITEM_FIRST,
    ITEM_FIRST_KEY,
    ITEM_HEAD,
    ITEM_NUM_KEYS,
    ITEM_PAGE,
    BlockQueries,
    build_block_queries,
)
from m3stack.engine.msa.prefill_plan import global_blocks, token_requests

# Default launch: 4 tokens x 16 heads = 64 MMA rows for one warp group, the next tile's rows
# prefetched into registers; two CTAs per SM (sm_90, Triton 3.6: 253 registers, 80 KiB of shared
# memory), so one CTA's softmax runs under the other's MMAs.
DEFAULT_TILE_ROWS = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_PREFETCH = True
DEFAULT_PIPELINED_NUM_STAGES = 2  # without the register prefetch
DEFAULT_TILES_PER_ITEM = 32
DEFAULT_MERGE_NUM_WARPS = 4
DEFAULT_MERGE_NUM_STAGES = 3
DEFAULT_MERGE_TOKENS = 2


# fmt: off
@triton.jit
def _tile_entries(entries_ptr, tile_lo, hi, TILE: tl.constexpr, GP: tl.constexpr):
    """Entries (``t_local * K + slot``) of the tile's rows: each query's repeated for its GP heads."""
    row_query = tl.arange(0, TILE * GP) // GP
    return tl.load(entries_ptr + tile_lo + row_query, mask=tile_lo + row_query < hi, other=0)


@triton.jit
def _gather_rows(
    q_ptr, positions_ptr, row_entry, tile_lo, hi, token_offset, head, stride_qt, stride_qh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, K: tl.constexpr, TILE: tl.constexpr,
):
    """Token positions and q rows ``[TILE * GP, DP]`` of a tile (rows past ``hi`` or G read as zero)."""
    m = tl.arange(0, TILE * GP)
    row_head = m % GP
    query_live = tile_lo + m // GP < hi
    row_token = (token_offset + row_entry // K).to(tl.int64)
    row_position = tl.load(positions_ptr + row_token, mask=query_live, other=2147483647)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + row_token[:, None] * stride_qt + (head * G + row_head)[:, None] * stride_qh + d[None, :],
                mask=(query_live & (row_head < G))[:, None] & (d[None, :] < D), other=0.0)
    return row_position, q


# Per-chunk offsets are not specialised: one compiled kernel serves every chunk (Triton would otherwise
# compile a variant for each divisibility of the offsets it sees, seconds each on the first chunks).
@triton.jit(do_not_specialize=["first_item", "token_offset"])
def _block_major_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, items_ptr, entries_ptr, part_o_ptr, part_lse_ptr,
    first_item, token_offset, scale_log2,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr,
    K: tl.constexpr, TILE: tl.constexpr, PREFETCH: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    item = items_ptr + (first_item + tl.program_id(0)).to(tl.int64) * ITEM_FIELDS
    head = tl.load(item + ITEM_HEAD)
    if head < 0:
        return  # the grid is an upper bound on the chunk's items
    lo = tl.load(item + ITEM_FIRST)
    hi = tl.load(item + ITEM_END)
    first_key = tl.load(item + ITEM_FIRST_KEY)
    keys, values = load_kv_block(
        k_ptr, v_ptr, tl.load(item + ITEM_PAGE).to(tl.int64), head, tl.load(item + ITEM_NUM_KEYS),
        stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb, B, D, DP, q_ptr.dtype.element_ty,
    )
    keys_t = tl.trans(keys)
    key_position = first_key + tl.arange(0, B)
    d = tl.arange(0, DP)
    # Rows are (query, head) pairs: a query's G heads are consecutive rows of q and of the partials.
    m = tl.arange(0, TILE * GP)
    row_head = m % GP
    row_entry = _tile_entries(entries_ptr, lo, hi, TILE, GP)
    if PREFETCH:
        next_position, next_q = _gather_rows(
            q_ptr, positions_ptr, row_entry, lo, hi, token_offset, head, stride_qt, stride_qh, G, GP, D, DP, K, TILE)
    for tile_lo in range(lo, hi, TILE):
        next_entry = _tile_entries(entries_ptr, tile_lo + TILE, hi, TILE, GP)
        if PREFETCH:  # the next tile's rows go to registers now and land while this tile computes
            row_position, q = next_position, next_q
            next_position, next_q = _gather_rows(
                q_ptr, positions_ptr, next_entry, tile_lo + TILE, hi, token_offset, head, stride_qt, stride_qh,
                G, GP, D, DP, K, TILE)
        else:  # the software pipeliner issues the gather num_stages - 1 tiles ahead, into shared memory
            row_position, q = _gather_rows(
                q_ptr, positions_ptr, row_entry, tile_lo, hi, token_offset, head, stride_qt, stride_qh,
                G, GP, D, DP, K, TILE)
        row_live = (tile_lo + m // GP < hi) & (row_head < G)
        scores = tl.dot(q, keys_t, input_precision=INPUT_PRECISION)
        if tl.min(row_position, axis=0) < first_key + B - 1:
            scores = tl.where(key_position[None, :] <= row_position[:, None], scores, NEG_INF)
        # The scale is folded into the exponent (one FMA per score); it is positive, so the row max
        # of the raw scores is the max of the scaled ones.
        row_max = tl.max(scores, axis=1)
        row_max = tl.where(row_max == NEG_INF, 0.0, row_max) * scale_log2
        probs = tl.exp2(scores * scale_log2 - row_max[:, None])
        row_sum = tl.sum(probs, axis=1)
        out = tl.dot(probs.to(values.dtype), values, input_precision=INPUT_PRECISION)
        out = out * (1.0 / tl.where(row_sum > 0, row_sum, 1.0))[:, None]
        lse = tl.where(row_sum > 0, row_max + tl.log2(row_sum), NEG_INF)
        # Partials are [chunk_tokens, HKV, K, G, D]; the entry names the token and the slot.
        part_row = (((row_entry // K).to(tl.int64) * HKV + head) * K + row_entry % K) * G + row_head
        tl.store(part_o_ptr + part_row[:, None] * D + d[None, :], out.to(part_o_ptr.dtype.element_ty),
                 mask=row_live[:, None] & (d[None, :] < D))
        tl.store(part_lse_ptr + part_row, lse, mask=row_live)
        row_entry = next_entry


@triton.jit(do_not_specialize=["token_offset", "chunk_len"])
def _merge_kernel(
    part_o_ptr, part_lse_ptr, sel_ptr, positions_ptr, out_ptr, token_offset, chunk_len,
    stride_sh, stride_st, stride_ot, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr,
    K: tl.constexpr, TOKENS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """TOKENS consecutive tokens of one KV head: out = sum_k 2^(lse_k - lse) O_k over each token's
    valid slots.

    A (token, KV head)'s partials are one contiguous K x G x D slab.  The slots are folded in one at
    a time with a running max and sum (the online softmax, over partials): no step waits on a
    reduction across lanes, and every load of an iteration (the slot's block id, its G LSEs, its
    G x D partial) has an address known from the loop index alone, so the pipeliner issues them
    ``NUM_STAGES - 1`` slots ahead, across token boundaries too.  A slot is valid when its block
    is selected and not in the token's future; an invalid slot's partial was never written (its
    LSE and values may be any bits), so it is masked by weight, never multiplied in.  A program
    holds a G x D accumulator, so many share an SM and keep enough loads in flight."""
    pid = tl.program_id(0)
    head = pid % HKV  # the HKV programs of a token group read one contiguous HKV x K x G x D region
    first = (pid // HKV) * TOKENS
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    g_live = g < G
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    run_max = tl.full((GP,), NEG_INF, tl.float32)
    run_sum = tl.zeros((GP,), dtype=tl.float32)
    for i in tl.range(TOKENS * K, num_stages=NUM_STAGES):
        t_local = first + i // K
        k = i % K
        token_live = t_local < chunk_len
        token = token_offset + t_local
        block = tl.load(sel_ptr + head * stride_sh + token * stride_st + k, mask=token_live, other=-1)
        q_block = tl.load(positions_ptr + token, mask=token_live, other=0) // B
        row = ((t_local.to(tl.int64) * HKV + head) * K + k) * G + g  # [GP] rows of [chunk * HKV * K * G, D]
        row_live = g_live & (t_local + tl.zeros_like(g) < chunk_len)  # a vector: the interpreter wants one
        lse = tl.load(part_lse_ptr + row, mask=row_live, other=NEG_INF)
        part = tl.load(part_o_ptr + row[:, None] * D + d[None, :], mask=row_live[:, None] & (d[None, :] < D), other=0.0)
        lse = tl.where((block >= 0) & (block <= q_block), lse, NEG_INF)
        new_max = tl.maximum(run_max, lse)
        base = tl.where(new_max == NEG_INF, 0.0, new_max)
        rescale = tl.exp2(run_max - base)
        weight = tl.exp2(lse - base)  # 0 for an invalid slot, whose part may hold NaN bits
        acc = acc * rescale[:, None] + tl.where(weight[:, None] > 0, weight[:, None] * part.to(tl.float32), 0.0)
        run_sum = run_sum * rescale + weight
        run_max = new_max
        if k == K - 1:  # the token's last slot: write its rows (rows with no valid slot stay 0)
            out = acc / tl.maximum(run_sum, 1e-30)[:, None]
            tl.store(out_ptr + token * stride_ot + (head * G + g[:, None]) * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & (d[None, :] < D))
            acc = tl.zeros((GP, DP), dtype=tl.float32)
            run_max = tl.full((GP,), NEG_INF, tl.float32)
            run_sum = tl.zeros((GP,), dtype=tl.float32)
# fmt: on


def chunk_tokens_for(num_q_heads: int, topk: int, head_dim: int, dtype: torch.dtype, workspace_bytes: int) -> int:
    """Tokens per chunk so that the chunk's partial outputs and LSEs fit ``workspace_bytes``."""
    per_token = num_q_heads * topk * (head_dim * dtype.itemsize + 4)
    return max(1, workspace_bytes // per_token)


@dataclass(frozen=True)
class BlockMajorPlan:
    """What the chunk loop needs: the inverted selection, the partials workspace, launch shapes."""

    csr: BlockQueries
    part_o: torch.Tensor  # [chunk_tokens, Hkv, K, G, D] in q's dtype
    part_lse: torch.Tensor  # [chunk_tokens, Hkv, K, G] float32
    tile_tokens: int
    tuning: PrefillTuning

    @property
    def num_chunks(self) -> int:
        return self.csr.num_chunks


def tile_tokens_for(group_padded: int, tuning: PrefillTuning) -> int:
    """Tokens per query tile: ``tile_tokens`` or DEFAULT_TILE_ROWS MMA rows, at least 16 rows for tl.dot."""
    return max(tuning.tile_tokens or DEFAULT_TILE_ROWS // group_padded, triton.cdiv(16, group_padded))


def plan_block_major(
    q: torch.Tensor, selection: torch.Tensor, metadata: AttentionMetadata, workspace_bytes: int, tuning: PrefillTuning
) -> BlockMajorPlan:
    """Invert ``selection`` and allocate the partials (arguments checked by ``sparse_prefill``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, topk = selection.shape
    dims = padded_dims(num_q_heads, num_kv_heads, head_dim)
    tile_tokens = tile_tokens_for(dims["GP"], tuning)
    chunk_tokens = min(num_tokens, chunk_tokens_for(num_q_heads, topk, head_dim, q.dtype, workspace_bytes))
    queries_per_item = tuning.queries_per_item or DEFAULT_TILES_PER_ITEM * tile_tokens
    csr = build_block_queries(
        selection, metadata.positions, token_requests(metadata), global_blocks(metadata), metadata.block_size,
        chunk_tokens, queries_per_item,
    )  # fmt: skip
    return BlockMajorPlan(
        csr=csr,
        part_o=torch.empty((chunk_tokens, num_kv_heads, topk, dims["G"], head_dim), dtype=q.dtype, device=q.device),
        part_lse=torch.empty((chunk_tokens, num_kv_heads, topk, dims["G"]), dtype=torch.float32, device=q.device),
        tile_tokens=tile_tokens,
        tuning=tuning,
    )


def attention_launch(tuning: PrefillTuning) -> dict[str, Any]:
    """The attention kernel's launch options for ``tuning``, defaults filled in."""
    prefetch = DEFAULT_PREFETCH if tuning.prefetch is None else tuning.prefetch
    return dict(
        PREFETCH=prefetch,
        num_warps=tuning.num_warps or DEFAULT_NUM_WARPS,
        num_stages=tuning.num_stages or (1 if prefetch else DEFAULT_PIPELINED_NUM_STAGES),
    )


def merge_launch(tuning: PrefillTuning) -> dict[str, Any]:
    """The merge kernel's launch options for ``tuning``, defaults filled in."""
    return dict(
        TOKENS=tuning.merge_tokens or DEFAULT_MERGE_TOKENS,
        NUM_STAGES=tuning.merge_num_stages or DEFAULT_MERGE_NUM_STAGES,
        num_warps=tuning.merge_num_warps or DEFAULT_MERGE_NUM_WARPS,
    )


def attend_chunk(
    plan: BlockMajorPlan,
    chunk: int,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> None:
    """Partial outputs and LSEs of chunk ``chunk``'s tokens, one per (token, KV head, selected block)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[1]
    csr = plan.csr
    _block_major_kernel[(csr.items_per_chunk,)](
        q, key_cache, value_cache, metadata.positions, csr.items, csr.entries, plan.part_o, plan.part_lse,
        chunk * csr.items_per_chunk, chunk * csr.chunk_tokens, scale * LOG2E,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        HKV=num_kv_heads, B=metadata.block_size, K=plan.part_o.shape[2], TILE=plan.tile_tokens,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **padded_dims(num_q_heads, num_kv_heads, head_dim), **attention_launch(plan.tuning),
    )  # fmt: skip


def merge_chunk(
    plan: BlockMajorPlan, chunk: int, selection: torch.Tensor, metadata: AttentionMetadata, out: torch.Tensor
) -> None:
    """``out`` rows of chunk ``chunk``'s tokens from their partials."""
    num_tokens, num_q_heads, head_dim = out.shape
    num_kv_heads, _, topk = selection.shape
    token_offset = chunk * plan.csr.chunk_tokens
    chunk_len = min(plan.csr.chunk_tokens, num_tokens - token_offset)
    launch = merge_launch(plan.tuning)
    _merge_kernel[(triton.cdiv(chunk_len, launch["TOKENS"]) * num_kv_heads,)](
        plan.part_o, plan.part_lse, selection, metadata.positions, out, token_offset, chunk_len,
        selection.stride(0), selection.stride(1), out.stride(0), out.stride(1),
        HKV=num_kv_heads, B=metadata.block_size, K=topk, **padded_dims(num_q_heads, num_kv_heads, head_dim), **launch,
    )  # fmt: skip


def block_major_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selection: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    workspace_bytes: int,
    tuning: PrefillTuning,
) -> None:
    """Write the sparse attention of ``q`` into ``out`` (arguments checked by ``sparse_prefill``)."""
    plan = plan_block_major(q, selection, metadata, workspace_bytes, tuning)
    for chunk in range(plan.num_chunks):
        attend_chunk(plan, chunk, q, key_cache, value_cache, metadata, scale)
        merge_chunk(plan, chunk, selection, metadata, out)
