"""KV-block-major sparse prefill (design/msa.md, kernel 4): one program per (KV head, selected block)
work item, then an LSE merge per token.

A work item (``prefill_csr``) is a run of at most ``queries_per_item`` queries that picked one
(KV head, block).  Its program loads the block's K and V once and loops over tiles of those
queries, ``TILE`` tokens x G query heads packed into the MMA M dimension; each row's softmax over
the block's keys is complete in one step (no rescaling loop), written as a normalised partial
output in q's dtype plus its base-2 LSE.  Only the query's own block can be partially visible, so
the causal mask is applied only to tiles that reach past the block's last key.  The merge kernel
combines each token's <= K partials per query head, online, reading every partial once.

Traffic per (token, KV head, selected block): q rows read (G x D), partial written and read back
(G x D each), so ~3 x G x D x itemsize bytes against 4 x G x B x D FLOPs: the partials, not the
MMAs, bound this kernel pair (design/msa.md).  Tokens run in chunks so the partials stay bounded.
"""

import torch
import triton
import triton.language as tl

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.msa.prefill_common import LOG2E, NEG_INF, PrefillTuning, load_kv_block, padded_dims
from m3stack.engine.msa.prefill_csr import build_block_queries
from m3stack.engine.msa.prefill_plan import global_blocks, token_requests


# fmt: off
@triton.jit
def _block_major_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, block_page_ptr, block_first_pos_ptr, block_num_keys_ptr,
    row_ptr_ptr, entries_ptr, item_bucket_ptr, item_start_ptr, chunk_items_ptr, part_o_ptr, part_lse_ptr,
    chunk, token_offset, num_blocks, queries_per_item, scale_log2,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr,
    K: tl.constexpr, TILE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    item = tl.load(chunk_items_ptr + chunk) + tl.program_id(0)
    if item >= tl.load(chunk_items_ptr + chunk + 1):
        return  # the grid is an upper bound on the chunk's items
    bucket = tl.load(item_bucket_ptr + item)
    lo = tl.load(item_start_ptr + item)
    hi = tl.minimum(lo + queries_per_item, tl.load(row_ptr_ptr + bucket + 1))
    block = bucket % num_blocks
    head = (bucket // num_blocks) % HKV
    first_key = tl.load(block_first_pos_ptr + block)
    keys, values = load_kv_block(
        k_ptr, v_ptr, tl.load(block_page_ptr + block), head, tl.load(block_num_keys_ptr + block),
        stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb, B, D, DP,
    )
    keys_t = tl.trans(keys)
    key_position = first_key + tl.arange(0, B)
    d = tl.arange(0, DP)
    # Rows are (query, head) pairs: a query's G heads are consecutive rows of q and of the partials.
    m = tl.arange(0, TILE * GP)
    row_query = m // GP
    row_head = m % GP
    for tile_lo in range(lo, hi, TILE):
        query_live = tile_lo + row_query < hi
        row_live = query_live & (row_head < G)
        row_entry = tl.load(entries_ptr + tile_lo + row_query, mask=query_live, other=0)  # t_local * K + slot
        row_token = (token_offset + row_entry // K).to(tl.int64)
        row_position = tl.load(positions_ptr + row_token, mask=query_live, other=2147483647)
        q = tl.load(q_ptr + row_token[:, None] * stride_qt + (head * G + row_head)[:, None] * stride_qh + d[None, :],
                    mask=row_live[:, None] & (d[None, :] < D), other=0.0)
        scores = tl.dot(q, keys_t, input_precision=INPUT_PRECISION) * scale_log2
        if tl.min(row_position, axis=0) < first_key + B - 1:
            scores = tl.where(key_position[None, :] <= row_position[:, None], scores, NEG_INF)
        row_max = tl.max(scores, axis=1)
        row_max = tl.where(row_max == NEG_INF, 0.0, row_max)
        probs = tl.exp2(scores - row_max[:, None])
        row_sum = tl.sum(probs, axis=1)
        out = tl.dot(probs.to(values.dtype), values, input_precision=INPUT_PRECISION)
        out = out / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        lse = tl.where(row_sum > 0, row_max + tl.log2(row_sum), NEG_INF)
        # Partials are [chunk_tokens, HKV, K, G, D]; the entry names the token and the slot.
        part_row = (((row_entry // K).to(tl.int64) * HKV + head) * K + row_entry % K) * G + row_head
        tl.store(part_o_ptr + part_row[:, None] * D + d[None, :], out.to(part_o_ptr.dtype.element_ty),
                 mask=row_live[:, None] & (d[None, :] < D))
        tl.store(part_lse_ptr + part_row, lse, mask=row_live)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, sel_ptr, positions_ptr, out_ptr, token_offset, stride_sh, stride_st, stride_ot, stride_oh,
    HKV: tl.constexpr, G: tl.constexpr, HQP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr,
    K: tl.constexpr,
):
    """One token, all query heads: out = sum_k 2^(lse_k - lse) O_k over each KV group's valid slots,
    combined online so every partial is read once."""
    t_local = tl.program_id(0).to(tl.int64)
    token = token_offset + t_local
    q_block = (tl.load(positions_ptr + token) // B).to(tl.int32)
    row = tl.arange(0, HQP)  # query head = kv_head * G + g
    head = row // G
    row_live = row < HKV * G
    d = tl.arange(0, DP)
    io_mask = row_live[:, None] & (d[None, :] < D)
    run_max = tl.full((HQP,), NEG_INF, dtype=tl.float32)
    total = tl.zeros((HQP,), dtype=tl.float32)
    acc = tl.zeros((HQP, DP), dtype=tl.float32)
    for k in range(K):
        block = tl.load(sel_ptr + head * stride_sh + token * stride_st + k, mask=row_live, other=-1).to(tl.int32)
        live = row_live & (block >= 0) & (block <= q_block)
        part_row = ((t_local * HKV + head) * K + k) * G + row % G
        lse = tl.load(part_lse_ptr + part_row, mask=live, other=NEG_INF)
        part = tl.load(part_o_ptr + part_row[:, None] * D + d[None, :], mask=live[:, None] & io_mask, other=0.0)
        new_max = tl.maximum(run_max, lse)
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)
        alpha = tl.exp2(run_max - safe_max)
        weight = tl.exp2(lse - safe_max)
        total = total * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * part.to(tl.float32)
        run_max = new_max
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + row[:, None] * stride_oh + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=io_mask)
# fmt: on


def chunk_tokens_for(num_q_heads: int, topk: int, head_dim: int, dtype: torch.dtype, workspace_bytes: int) -> int:
    """Tokens per chunk so that the chunk's partial outputs and LSEs fit ``workspace_bytes``."""
    per_token = num_q_heads * topk * (head_dim * dtype.itemsize + 4)
    return max(1, workspace_bytes // per_token)


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
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, topk = selection.shape
    dims = padded_dims(num_q_heads, num_kv_heads, head_dim)
    block_size = metadata.block_size
    # TILE * GP rows per query tile: 128 for M3 (8 tokens x 16 heads), at least 16 for tl.dot.
    tile_tokens = max(tuning.tile_tokens or 128 // dims["GP"], triton.cdiv(16, dims["GP"]))
    chunk_tokens = min(num_tokens, chunk_tokens_for(num_q_heads, topk, head_dim, q.dtype, workspace_bytes))
    blocks = global_blocks(metadata)
    csr = build_block_queries(
        selection, metadata.positions, token_requests(metadata), blocks, block_size, chunk_tokens,
        tuning.queries_per_item or 16 * tile_tokens,
    )  # fmt: skip
    part_o = torch.empty((chunk_tokens, num_kv_heads, topk, dims["G"], head_dim), dtype=q.dtype, device=q.device)
    part_lse = torch.empty((chunk_tokens, num_kv_heads, topk, dims["G"]), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    for chunk in range(csr.num_chunks):
        token_offset = chunk * chunk_tokens
        _block_major_kernel[(csr.items_bound(chunk, num_tokens, num_kv_heads, topk),)](
            q, key_cache, value_cache, metadata.positions, blocks.page, blocks.first_position, blocks.num_keys,
            csr.row_ptr, csr.entries, csr.item_bucket, csr.item_start, csr.chunk_items, part_o, part_lse,
            chunk, token_offset, csr.num_blocks, csr.queries_per_item, scale * LOG2E,
            q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
            HKV=num_kv_heads, B=block_size, K=topk, TILE=tile_tokens,
            INPUT_PRECISION=precision, num_warps=tuning.num_warps or 8, num_stages=tuning.num_stages or 2, **dims,
        )  # fmt: skip
        _merge_kernel[(min(chunk_tokens, num_tokens - token_offset),)](
            part_o, part_lse, selection, metadata.positions, out,
            token_offset, selection.stride(0), selection.stride(1), out.stride(0), out.stride(1),
            HKV=num_kv_heads, G=dims["G"], HQP=triton.next_power_of_2(num_q_heads), D=head_dim, DP=dims["DP"],
            B=block_size, K=topk, num_warps=tuning.merge_num_warps or 4,
        )  # fmt: skip
