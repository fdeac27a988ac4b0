"""What the sparse prefill attention kernels share: launch tuning, Triton building blocks."""

import dataclasses

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
LOG2E = 1.4426950408889634  # softmax runs in base 2: scores are pre-scaled by log2(e)


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters of the sparse prefill kernels; ``None`` picks the default."""

    tile_tokens: int | None = None  # block-major: tokens per query tile (x G heads = MMA M rows)
    queries_per_item: int | None = None  # block-major: most queries one work item serves
    num_warps: int | None = None  # block-major attention kernel
    # block-major: load the next tile's q rows into registers during this tile (True), or let the
    # software pipeliner stage them in shared memory num_stages - 1 tiles ahead (False)
    prefetch: bool | None = None
    num_stages: int | None = None  # block-major (pipeliner path) and query-major kernels
    merge_num_warps: int | None = None
    merge_num_stages: int | None = None  # partials in flight per merge program, plus one
    merge_tokens: int | None = None  # consecutive tokens (of one KV head) per merge program
    query_major_num_warps: int | None = None


# fmt: off
@triton.jit
def load_kv_block(
    k_ptr, v_ptr, page, head, num_keys, stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vb,
    B: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DTYPE: tl.constexpr,
):
    """K and V ``[B, DP]`` of one (page, KV head) in ``DTYPE`` (the queries'; an fp8 cache's tiles are widened
    exactly, through fp16).  Slots at or past ``num_keys`` read as zero: they hold no key yet (possibly NaN
    garbage), and 0 * NaN in P @ V would poison the row even with P = 0."""
    n = tl.arange(0, B)
    d = tl.arange(0, DP)
    mask = (n[:, None] < num_keys) & (d[None, :] < D)
    keys = tl.load(k_ptr + page * stride_kp + head * stride_kh + n[:, None] * stride_kb + d[None, :],
                   mask=mask, other=0.0)
    values = tl.load(v_ptr + page * stride_vp + head * stride_vh + n[:, None] * stride_vb + d[None, :],
                     mask=mask, other=0.0)
    if keys.dtype == tl.float8e4nv:
        keys = keys.to(tl.float16).to(DTYPE)
        values = values.to(tl.float16).to(DTYPE)
    return keys, values
# fmt: on


def padded_dims(num_q_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """Constexpr shape arguments: group size G and head dim D with their power-of-two paddings."""
    group = num_q_heads // num_kv_heads
    return dict(G=group, GP=triton.next_power_of_2(group), D=head_dim, DP=max(16, triton.next_power_of_2(head_dim)))
