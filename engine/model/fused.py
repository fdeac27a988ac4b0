"""The decoder's elementwise ops, one Triton kernel each, for CUDA tensors.

Eager PyTorch runs M3's Gemma RMSNorm as ~8 kernels (cast, square, mean, rsqrt, two scales, cast back), the
SwiGLU-OAI gate as ~8 and a head group's RMSNorm + partial RoPE as ~20 (norm, slices, negation, two
concatenations, products, sum).  On the H200 with the serving benchmark's model (M3 attention dims, 8 layers)
those ~100 launches per layer took a third of the GPU time of an 8192-token prefill step and of a 64-request
decode step.  Each function here does what its torch twin (``norm.gemma_rms_norm``, ``mlp.swiglu_oai``,
``rope.apply_rotary`` after a head norm) does, in one pass over the rows, and rounds where the torch ops round
(to the activations' dtype after every bf16 op), so the fused outputs equal the eager ones except where the
norm's float32 sum of squares adds in another order.

The MoE's combine (``moe.combine_expert_rows``: each token's routing-weighted sum of its experts' output rows)
reads the grouped GEMM's rows where they lie instead of unpermuting them, upcasting, scaling and summing in four
passes over ``[tokens x top-k, hidden]``, and finishes the layer in the same pass (the routed scaling, the rounding
to bf16, the shared expert's output added: three launches of a decode step).  Its dispatch (``moe.dispatch``:
the tokens' rows in expert order, each pair's sorted row, each expert's end row, the count of pairs run) is one
kernel instead of eight launches after ``torch.sort`` (a division, a gather, a scatter, two aranges, a search, a
compare and a sum); for a decode step's few pairs that kernel also sorts them (``torch.sort`` of up to 4096
values is four launches, by ATen's ``cuda/Sort.cpp``: an arange, two copies, the sort).  Its router
(``moe.Router``: sigmoid, the correction bias, top-k, the chosen scores renormalized) is one kernel a token after
the router's GEMM instead of eight (~20 us of a 1-token MoE step on the H200).

The callers (``norm.GemmaRMSNorm``, ``mlp``, ``attention``, ``moe``) use these for CUDA tensors and their torch
twins elsewhere; the tests run both on CPU under ``TRITON_INTERPRET=1`` and compare them.
"""

import torch
import triton
import triton.language as tl

_SWIGLU_BLOCK = 1024
_COMBINE_BLOCK = 1024
_DISPATCH_BLOCK = 1024
# The most token-expert pairs ``dispatch`` ranks in one kernel (each pair reads every pair's id: quadratic work),
# 64 decode tokens at top-8; a larger step sorts with torch.sort first.  A bound chosen, not measured.
RANKED_PAIRS = 512


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to the activations' dtype, where the torch op would store its result.

    bfloat16 rounds to nearest even by hand: Triton's CPU interpreter truncates in ``.to(tl.bfloat16)``
    (the GPU rounds), so the interpreted tests would otherwise check another function.  A rounded value
    then converts exactly either way.
    """
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr test Triton resolves at compile time)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    n, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One row: ``out = x / rms(x) * (1 + weight)``; with a residual, ``x`` is first ``x + residual`` (rounded
    as torch's add rounds), which is also written to ``residual_out``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = _rounded(x.to(tl.float32) + residual.to(tl.float32), x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(hidden * hidden, axis=0) / n + eps)
    scale = 1.0 + tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _rounded(hidden * inverse_rms * scale, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, intermediate, alpha, limit,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``; gate is the first half of a row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    gain = _rounded(tl.sigmoid(_rounded(gate * alpha, dtype)), dtype)
    glu = _rounded(gate * gain, dtype)
    tl.store(out_ptr + row * stride_out + cols, _rounded(_rounded(up + 1.0, dtype) * glu, dtype).to(dtype), mask=mask)


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_cos, stride_ot, stride_oh,
    heads, eps,
    HEADS_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, ROTARY: tl.constexpr,
):  # fmt: skip
    """One token's heads: RMSNorm of each head (one weight shared by the heads), rounded, then RoPE in
    "rotate half" layout on the first ``ROTARY`` channels (each product and the sum rounded)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, D_P)[None, :]
    mask = (head < heads) & (dim < D)
    dtype = out_ptr.dtype.element_ty
    row = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(row + dim, mask=mask, other=0.0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    normed = _rounded(x * inverse_rms * (1.0 + tl.load(weight_ptr + dim, mask=dim < D).to(tl.float32)), dtype)
    # The partner of channel i in "rotate half" (i + R/2 or i - R/2), normalized by the same formula.
    half: tl.constexpr = ROTARY // 2
    rotary = dim < ROTARY
    partner = tl.where(dim < half, dim + half, dim - half)
    partner = tl.where(rotary, partner, dim)
    x_partner = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    weight_partner = tl.load(weight_ptr + partner, mask=dim < D).to(tl.float32)
    normed_partner = _rounded(x_partner * inverse_rms * (1.0 + weight_partner), dtype)
    signed_partner = tl.where(dim < half, -normed_partner, normed_partner)
    cos = tl.load(cos_ptr + token * stride_cos + dim, mask=rotary, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + dim, mask=rotary, other=0.0).to(tl.float32)
    rotated = _rounded(_rounded(normed * cos, dtype) + _rounded(signed_partner * sin, dtype), dtype)
    out = tl.where(rotary, rotated, normed)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dim, out.to(dtype), mask=mask)


@triton.jit
def _combine_experts_kernel(
    rows_ptr, position_ptr, weights_ptr, owned_ptr, shared_ptr, out_ptr, stride_rows, stride_shared, hidden, scale,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """``out[t] = sum over slots s of weights[t, s] * rows[position[t, s]]`` in float32, slots in order; a row at
    or past ``owned`` (a pair no GEMM ran) adds zero whatever it holds.  ``FINISH``: the layer's output instead,
    ``(out[t] * scale)`` rounded to the shared output's dtype plus ``shared[t]`` (rounded as torch's add rounds)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    owned = tl.load(owned_ptr)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        position = tl.load(position_ptr + token * TOP_K + slot)
        weight = tl.load(weights_ptr + token * TOP_K + slot)
        width = tl.where(position < owned, hidden, 0)  # a row no GEMM ran: read none of it
        value = tl.load(rows_ptr + position * stride_rows + cols, mask=cols < width, other=0.0)
        total += value.to(tl.float32) * weight
    if FINISH:
        dtype = out_ptr.dtype.element_ty
        shared = tl.load(shared_ptr + token * stride_shared + cols, mask=cols < hidden, other=0.0)
        total = _rounded(_rounded(total * scale, dtype) + shared.to(tl.float32), dtype)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _copy_token_row(x_ptr, inputs_ptr, token, row, stride_x, stride_inputs, hidden, BLOCK: tl.constexpr):
    """Columns block ``program_id(1)`` of ``x[token]`` into ``inputs[row]``."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(x_ptr + token * stride_x + cols, mask=cols < hidden)
    tl.store(inputs_ptr + row * stride_inputs + cols, values, mask=cols < hidden)


@triton.jit
def _store_end_rows(
    ends_ptr, lowest, upper, group_id, first_row, pairs, experts,
    EXPERTS_P: tl.constexpr,
):  # fmt: skip
    """``ends[e]`` (the first sorted row whose id exceeds ``e``) for ``lowest <= e < upper``, the experts whose ends
    fall on the first row of the group of id ``group_id``: that row below the id, ``pairs`` (one past the last row)
    from it on."""
    expert = tl.arange(0, EXPERTS_P)
    mask = (expert >= lowest) & (expert < upper) & (expert < experts)
    tl.store(ends_ptr + expert, tl.where(expert < group_id, first_row, pairs), mask=mask)


@triton.jit
def _dispatch_kernel(
    x_ptr, ids_ptr, order_ptr, inputs_ptr, position_ptr, ends_ptr, stride_x, stride_inputs, hidden, pairs, experts,
    TOP_K: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Sorted row ``program_id(0)`` (``ids`` sorted, ``order`` the sort's): its pair's token row, a block of columns
    a program.  Block 0 also writes the pair's position, ``position[order[row]] = row``, and the end rows that fall
    on this row: the experts from the row before's id up to this row's, to the last for the last row."""
    row = tl.program_id(0).to(tl.int64)
    pair = tl.load(order_ptr + row)
    _copy_token_row(x_ptr, inputs_ptr, pair // TOP_K, row, stride_x, stride_inputs, hidden, BLOCK)
    if tl.program_id(1) == 0:
        tl.store(position_ptr + pair, row)
        this_id = tl.load(ids_ptr + row)
        previous_id = tl.where(row > 0, tl.load(ids_ptr + tl.maximum(row - 1, 0)), 0)
        upper = tl.where(row == pairs - 1, experts, this_id)
        _store_end_rows(ends_ptr, previous_id, upper, this_id, row, pairs, experts, EXPERTS_P)


@triton.jit
def _rank_dispatch_kernel(
    x_ptr, ids_ptr, inputs_ptr, position_ptr, ends_ptr, stride_x, stride_inputs, hidden, pairs, experts,
    TOP_K: tl.constexpr, EXPERTS_P: tl.constexpr, PAIRS_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``_dispatch_kernel`` without the sort, for a few pairs: pair ``program_id(0)`` finds its sorted row among
    all ``pairs`` (the ``ids`` in flat order, at most ``PAIRS_P``): the pairs of lower ids, then those of its id
    that come before it (a stable sort).  The pairs of an id write the same end rows, those falling on their
    group's first row: from the next lower id present (or 0) up to their own, to the last for the highest id."""
    pair = tl.program_id(0).to(tl.int64)
    this_id = tl.load(ids_ptr + pair)
    each = tl.arange(0, PAIRS_P)
    live = each < pairs
    each_id = tl.load(ids_ptr + each, mask=live, other=0)
    lower = live & (each_id < this_id)
    earlier = live & (each_id == this_id) & (each < pair)
    higher = live & (each_id > this_id)
    first_row = tl.sum(lower.to(tl.int32), axis=0)
    row = first_row + tl.sum(earlier.to(tl.int32), axis=0)
    _copy_token_row(x_ptr, inputs_ptr, pair // TOP_K, row, stride_x, stride_inputs, hidden, BLOCK)
    if tl.program_id(1) == 0:
        tl.store(position_ptr + pair, row)
        previous_id = tl.max(tl.where(lower, each_id, 0), axis=0)
        upper = tl.where(tl.sum(higher.to(tl.int32), axis=0) == 0, experts, this_id)
        _store_end_rows(ends_ptr, previous_id, upper, this_id, first_row, pairs, experts, EXPERTS_P)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, experts, stride_logits,
    TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, EXPERTS_P: tl.constexpr,
):  # fmt: skip
    """Token ``program_id(0)``: its ``TOP_K`` experts by ``sigmoid(logit) + bias`` (best first, the lowest id among
    ties) and their sigmoid scores over the chosen scores' sum."""
    token = tl.program_id(0).to(tl.int64)
    expert = tl.arange(0, EXPERTS_P)
    live = expert < experts
    scores = tl.sigmoid(tl.load(logits_ptr + token * stride_logits + expert, mask=live, other=0.0).to(tl.float32))
    choice = tl.where(live, scores + tl.load(bias_ptr + expert, mask=live, other=0.0), float("-inf"))
    slot = tl.arange(0, TOP_K_P)
    chosen = tl.zeros([TOP_K_P], dtype=tl.int64)
    chosen_scores = tl.zeros([TOP_K_P], dtype=tl.float32)
    for rank in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        chosen = tl.where(slot == rank, best, chosen)
        chosen_scores = tl.where(slot == rank, tl.sum(tl.where(expert == best, scores, 0.0), axis=0), chosen_scores)
        choice = tl.where(expert == best, float("-inf"), choice)
    real = slot < TOP_K
    tl.store(ids_ptr + token * TOP_K + slot, chosen, mask=real)
    tl.store(weights_ptr + token * TOP_K + slot, chosen_scores / tl.sum(chosen_scores, axis=0), mask=real)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.Router``'s selection from its GEMM's ``logits`` ``[T, E]``: expert ids ``[T, k]`` int64 (best first)
    and their weights ``[T, k]`` float32."""
    num_tokens, experts = logits.shape
    if top_k > experts:
        raise ValueError(f"top-{top_k} of {experts} experts")
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    if num_tokens:
        logits = _row_view(logits)
        _route_kernel[(num_tokens,)](
            logits, bias.float().contiguous(), ids, weights, experts, logits.stride(0),
            TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k), EXPERTS_P=triton.next_power_of_2(experts),
            num_warps=4,
        )  # fmt: skip
    return ids, weights


def dispatch(
    x: torch.Tensor, expert_ids: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe.dispatch``: the inputs ``[T * k, H]``, each pair's sorted row and each expert's end row (int32).  Up to
    ``RANKED_PAIRS`` pairs (decode steps) one kernel, each pair counting the pairs sorted before it, instead of
    ``torch.sort`` and ``dispatch_sorted``; a larger step sorts first."""
    pairs, top_k = expert_ids.numel(), expert_ids.shape[1]
    if not pairs or pairs > RANKED_PAIRS:
        row_ids, order = torch.sort(expert_ids.flatten(), stable=True)
        return dispatch_sorted(x, row_ids, order, top_k, experts)
    x, ids = _row_view(x), expert_ids.flatten().contiguous()
    inputs = torch.empty((pairs, x.shape[1]), dtype=x.dtype, device=x.device)
    position = torch.empty(pairs, dtype=torch.int64, device=x.device)
    ends = torch.empty(experts, dtype=torch.int32, device=x.device)
    _rank_dispatch_kernel[(pairs, triton.cdiv(x.shape[1], _DISPATCH_BLOCK))](
        x, ids, inputs, position, ends, x.stride(0), inputs.stride(0), x.shape[1], pairs, experts,
        TOP_K=top_k, EXPERTS_P=triton.next_power_of_2(experts), PAIRS_P=RANKED_PAIRS, BLOCK=_DISPATCH_BLOCK,
        num_warps=4,
    )  # fmt: skip
    return inputs, position, ends


def dispatch_sorted(
    x: torch.Tensor, row_ids: torch.Tensor, order: torch.Tensor, top_k: int, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe.dispatch`` after ``torch.sort`` (``row_ids, order``), one program per sorted row and block of
    columns."""
    pairs = order.numel()
    x = _row_view(x)
    inputs = torch.empty((pairs, x.shape[1]), dtype=x.dtype, device=x.device)
    position = torch.empty_like(order)
    if not pairs:
        return inputs, position, torch.zeros(experts, dtype=torch.int32, device=order.device)
    ends = torch.empty(experts, dtype=torch.int32, device=order.device)
    _dispatch_kernel[(pairs, triton.cdiv(x.shape[1], _DISPATCH_BLOCK))](
        x, row_ids, order, inputs, position, ends, x.stride(0), inputs.stride(0), x.shape[1], pairs, experts,
        TOP_K=top_k, EXPERTS_P=triton.next_power_of_2(experts), BLOCK=_DISPATCH_BLOCK, num_warps=4,
    )  # fmt: skip
    return inputs, position, ends


def combine_expert_rows(
    rows: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor,
    owned: torch.Tensor,
    scale: float = 1.0,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe.combine_expert_rows``: float32 ``[T, hidden]`` from the expert-sorted ``rows`` ``[T * k, hidden]``;
    given the ``shared`` expert's output ``[T, hidden]``, the layer's output in its dtype,
    ``(sums * scale).to(shared.dtype) + shared``, rounded where those torch ops round.

    Compiled without fused multiply-adds, as the torch ops run: each weighted row and the scaled sum are rounded
    to float32 before they are added, so the output equals the eager one but for the order of the slots' sum."""
    num_tokens, top_k = weights.shape
    out = torch.empty((num_tokens, rows.shape[1]), dtype=torch.float32, device=rows.device)
    if shared is not None:
        if shared.shape != out.shape:
            raise ValueError(f"shared output {tuple(shared.shape)} must be the combined {tuple(out.shape)}")
        out = torch.empty_like(out, dtype=shared.dtype)
        shared = _row_view(shared)
    if num_tokens:
        rows = _row_view(rows)
        grid = (num_tokens, triton.cdiv(rows.shape[1], _COMBINE_BLOCK))
        _combine_experts_kernel[grid](
            rows, position, weights.float().contiguous(), owned.reshape(1), out if shared is None else shared, out,
            rows.stride(0), 0 if shared is None else shared.stride(0), rows.shape[1], scale,
            TOP_K=top_k, BLOCK=_COMBINE_BLOCK, FINISH=shared is not None, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, n]`` without a copy where its last dimension is contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm.gemma_rms_norm`` over the last dimension, one program per row."""
    rows = _row_view(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(rows.shape[1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows, weight, out, out, rows.stride(0), rows.stride(0), out.stride(0), out.stride(0),
        rows.shape[1], eps, BLOCK=block, HAS_RESIDUAL=False, num_warps=_norm_warps(block),
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemma_rms_norm(x + residual), x + residual)`` for ``[T, n]`` tensors, in one pass."""
    if x.shape != residual.shape or x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be the same [T, n]")
    x, residual = _row_view(x), _row_view(residual)
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, summed, x.stride(0), residual.stride(0), out.stride(0), summed.stride(0),
        x.shape[1], eps, BLOCK=block, HAS_RESIDUAL=True, num_warps=_norm_warps(block),
    )  # fmt: skip
    return out, summed


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``mlp.swiglu_oai`` of ``[..., 2I]`` -> ``[..., I]``."""
    rows = _row_view(gate_up)
    intermediate = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(intermediate, _SWIGLU_BLOCK))
        _swiglu_kernel[grid](rows, out, rows.stride(0), out.stride(0), intermediate, alpha, limit,
                             BLOCK=_SWIGLU_BLOCK, num_warps=4)  # fmt: skip
    return out.view(*gate_up.shape[:-1], intermediate)


def head_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """``apply_rotary(gemma_rms_norm(x, weight, eps), cos, sin)`` for ``x`` ``[T, H, D]`` (any strides with a
    contiguous last dimension, e.g. a slice of the fused projection) -> a contiguous ``[T, H, D]``."""
    num_tokens, heads, head_dim = x.shape
    rotary = cos.shape[-1]
    if rotary % 2 or rotary > head_dim:
        raise ValueError(f"rotary dim {rotary} must be even and at most the head dim {head_dim}")
    if cos.shape != (num_tokens, rotary) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [{num_tokens}, R]")
    if x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("x and cos/sin need a contiguous last dimension")
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        heads_p, dims_p = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
        _head_norm_rope_kernel[(num_tokens,)](
            x, weight, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            heads, eps, HEADS_P=heads_p, D=head_dim, D_P=dims_p, ROTARY=rotary, num_warps=_norm_warps(heads_p * dims_p),
        )  # fmt: skip
    return out
