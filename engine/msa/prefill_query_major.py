"""Query-major sparse prefill: one program per (token, KV head) walks the token's selected blocks
with an online softmax, the G query heads as the MMA M rows (padded to 16).

No workspace and no inversion, but every token reloads K and V of each block it selected
(``K x 2 x B x D x itemsize`` bytes per token and KV head, 1 MiB for M3), mostly from HBM once the
cache outgrows L2: kept as the side-by-side peer of the KV-block-major kernel and as a fallback.
"""

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.msa.prefill_common import LOG2E, NEG_INF, load_kv_block, padded_dims
from m3stack.engine.msa.prefill_plan import token_requests


# fmt: off
@triton.jit
def _query_major_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, positions_ptr, token_request_ptr, page_table_ptr, seq_lens_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb,
    stride_sh, stride_st, stride_pt, stride_ot, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr, K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    request = tl.load(token_request_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + request)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    io_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + token * stride_qt + (head * G + g)[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    run_max = tl.full((GP,), NEG_INF, dtype=tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    for k in range(K):
        # Branch-free, so the pipeliner can prefetch the next blocks: an invalid slot (-1, or a
        # block after the token's own) loads nothing and scores -inf.
        block = tl.load(sel_ptr + head * stride_sh + token * stride_st + k).to(tl.int32)
        live = (block >= 0) & (block <= position // B)
        page = tl.load(page_table_ptr + request * stride_pt + block, mask=live, other=0).to(tl.int64)
        keys, values = load_kv_block(
            k_ptr, v_ptr, page, head, tl.where(live, seq_len - block * B, 0),
            stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb, B, D, DP, q_ptr.dtype.element_ty,
        )
        key_position = block * B + tl.arange(0, B)
        scores = tl.dot(q, tl.trans(keys), input_precision=INPUT_PRECISION) * scale_log2
        scores = tl.where(live & (key_position[None, :] <= position), scores, NEG_INF)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        alpha = tl.exp2(run_max - safe_max)
        total = total * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=INPUT_PRECISION)
        run_max = new_max
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + (head * G + g)[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=io_mask)
# fmt: on


def query_major_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selection: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Write the sparse attention of ``q`` into ``out`` (arguments checked by ``sparse_prefill``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, topk = selection.shape
    dims = padded_dims(num_q_heads, num_kv_heads, head_dim)
    dims["GP"] = max(16, dims["GP"])  # tl.dot needs M >= 16
    _query_major_kernel[(num_tokens, num_kv_heads)](
        q, key_cache, value_cache, selection, metadata.positions, token_requests(metadata), metadata.page_table,
        metadata.seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        selection.stride(0), selection.stride(1), metadata.page_table.stride(0), out.stride(0), out.stride(1),
        B=metadata.block_size, K=topk, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or 4, num_stages=num_stages or 2, **dims,
    )  # fmt: skip
