"""The fused decoder kernels (Triton, interpreted on CPU) against their eager torch twins."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.model import fused, moe
from m3stack.engine.model.mlp import swiglu_oai
from m3stack.engine.model.norm import gemma_rms_norm
from m3stack.engine.model.rope import apply_rotary, inverse_frequencies, text_cos_sin

DTYPES = [torch.float32, torch.bfloat16]


def random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the float32 sum of squares' order: bf16 results may differ by one rounding step."""
    if expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)
        assert (actual != expected).float().mean() < 0.02, "more than a few rows' roundings differ"
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 96])
def test_rms_norm_matches_torch_on_strided_rows(dtype: torch.dtype, width: int) -> None:
    wide = random(6, width + 8, seed=1, scale=3.0).to(dtype)
    x = wide[:, 4 : 4 + width]  # rows strided wider than they are long
    weight = random(width, seed=2, scale=0.5).to(dtype)
    assert_norm_close(fused.rms_norm(x, weight, 1e-6), gemma_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(dtype: torch.dtype) -> None:
    x, residual = random(7, 48, seed=3).to(dtype), random(7, 48, seed=4, scale=10.0).to(dtype)
    weight = random(48, seed=5, scale=0.5).to(dtype)
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    assert_norm_close(normed, gemma_rms_norm(x + residual, weight, 1e-5))


def test_add_rms_norm_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must be the same"):
        fused.add_rms_norm(torch.zeros(3, 8), torch.zeros(3, 16), torch.zeros(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_torch_with_values_past_the_clamp(dtype: torch.dtype) -> None:
    # 3 rows of 2 x 1100: two column blocks, the second partial; scale 6 puts many values past limit 7.
    gate_up = random(3, 2200, seed=6, scale=6.0).to(dtype)
    expected = swiglu_oai(gate_up, 1.702, 7.0)
    actual = fused.swiglu_oai(gate_up, 1.702, 7.0)
    assert actual.shape == (3, 1100)
    if dtype == torch.bfloat16:
        # Rounded where eager rounds: equal except where float32 exp differs in its last bit at a rounding edge.
        assert (actual != expected).float().mean() < 1e-3
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert fused.swiglu_oai(gate_up[:0], 1.702, 7.0).shape == (0, 1100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim", "rotary"), [(3, 32, 16), (1, 24, 12), (5, 16, 16)])
def test_head_norm_rope_matches_norm_then_rotary(dtype: torch.dtype, heads: int, head_dim: int, rotary: int) -> None:
    num_tokens = 6
    # A slice of a fused projection's output, as the attention layer passes it.
    projection = random(num_tokens, heads * head_dim + 40, seed=7, scale=2.0).to(dtype)
    x = projection[:, 8 : 8 + heads * head_dim].view(num_tokens, heads, head_dim)
    weight = random(head_dim, seed=8, scale=0.5).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 4095, 70000])
    cos, sin = text_cos_sin(positions, inverse_frequencies(rotary, 5e6), dtype)
    expected = apply_rotary(gemma_rms_norm(x, weight, 1e-6), cos, sin)
    actual = fused.head_norm_rope(x, weight, cos, sin, 1e-6)
    assert actual.is_contiguous() and actual.shape == expected.shape
    assert_norm_close(actual, expected)


def test_head_norm_rope_refuses_an_odd_rotary_width() -> None:
    cos = torch.ones(2, 5)
    with pytest.raises(ValueError, match="must be even"):
        fused.head_norm_rope(torch.zeros(2, 1, 8), torch.zeros(8), cos, cos, 1e-6)


def expert_rows(
    dtype: torch.dtype, num_tokens: int, top_k: int, skipped: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A combine's inputs: expert-sorted rows (two column blocks, the second partial), the last ``skipped`` of them
    NaN (pairs no GEMM ran), each pair's row (``position``), the routing weights and ``owned``."""
    pairs = num_tokens * top_k
    rows = random(pairs, 1100, seed=seed, scale=2.0).to(dtype)
    rows[pairs - skipped :] = float("nan")
    position = torch.randperm(pairs, generator=torch.Generator().manual_seed(seed + 1))
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(seed + 2))
    return rows, position, weights, torch.tensor(pairs - skipped)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k", "skipped"), [(5, 2, 0), (7, 8, 0), (6, 4, 9), (3, 2, 6)])
def test_combine_expert_rows_matches_torch(dtype: torch.dtype, num_tokens: int, top_k: int, skipped: int) -> None:
    """Expert-sorted rows back to tokens, weighted, slots in order; the ``skipped`` rows sorted last (pairs no
    GEMM ran) hold NaN and must add zero (the last case: every pair skipped)."""
    rows, position, weights, owned = expert_rows(dtype, num_tokens, top_k, skipped, seed=3)
    expected = moe.combine_expert_rows(rows, position, weights, owned)
    actual = fused.combine_expert_rows(rows, position, weights, owned)
    assert not expected.isnan().any()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    if skipped == num_tokens * top_k:
        assert torch.equal(actual, torch.zeros_like(actual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "skipped"), [(5, 0), (4, 7)])
def test_combine_finishes_the_layer_as_the_torch_ops_round(dtype: torch.dtype, num_tokens: int, skipped: int) -> None:
    """Given the shared expert's output, the combine writes the layer's output, ``(sums * scale).to(dtype) +
    shared``, equal bit for bit to those torch ops on its own float32 sums (scale 1.3: the products round)."""
    rows, position, weights, owned = expert_rows(dtype, num_tokens, 4, skipped, seed=9)
    finish = moe.Finish(1.3, random(num_tokens, rows.shape[1], seed=12, scale=4.0).to(dtype))
    sums = fused.combine_expert_rows(rows, position, weights, owned)
    actual = fused.combine_expert_rows(rows, position, weights, owned, finish.scale, finish.shared)
    assert actual.dtype == dtype and not actual.isnan().any()
    assert torch.equal(actual, finish.apply(sums))
    eager = moe.combine_expert_rows(rows, position, weights, owned, finish)  # the torch twin, summing its own way
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6  # a sum one float32 step apart may round one bf16 step apart
    torch.testing.assert_close(actual.float(), eager.float(), rtol=rtol, atol=1e-5)


def test_combine_refuses_a_shared_output_of_another_shape() -> None:
    with pytest.raises(ValueError, match="must be the combined"):
        fused.combine_expert_rows(torch.zeros(4, 8), torch.arange(4), torch.ones(2, 2), torch.tensor(4), 2.0,
                                  torch.zeros(2, 16))  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "experts", "skipped"),
    [(10, 4, 16, 0), (10, 4, 16, 15), (3, 1, 128, 0), (1, 1, 4, 0), (3, 4, 5, 12), (64, 8, 128, 100), (65, 8, 8, 9)],
    ids=["spread", "some-skipped", "few-pairs-many-experts", "one-pair", "all-skipped", "most-ranked", "sorted"],
)
def test_dispatch_matches_the_sort_and_torch(num_tokens: int, top_k: int, experts: int, skipped: int) -> None:
    """The tokens' rows in expert order (two column blocks, the second partial), each pair's sorted row and each
    expert's end row (``ends[-1]``: the pairs with an id below ``experts``), as ``torch.sort``'s stable order, the
    gather, the scatter and the search give them: after the sort (``dispatch_sorted``) and with the pairs ranked
    in the kernel (``dispatch``, up to ``RANKED_PAIRS``; the last case, past it, sorts first).  The skip id
    ``experts`` sorts last; ties keep the flat order."""
    pairs = num_tokens * top_k
    generator = torch.Generator().manual_seed(pairs + experts)
    ids = torch.randint(0, experts, (pairs,), generator=generator)
    ids[torch.randperm(pairs, generator=generator)[:skipped]] = experts
    x = random(num_tokens, 1100, seed=pairs).to(torch.bfloat16)
    row_ids, order = torch.sort(ids, stable=True)
    expected = moe.dispatch_sorted_eager(x, row_ids, order, top_k, experts)
    assert int(expected[2][-1]) == pairs - skipped
    sorted_first = fused.dispatch_sorted(x, row_ids, order, top_k, experts)
    for actual in (sorted_first, fused.dispatch(x, ids.view(num_tokens, top_k), experts)):
        assert [a.dtype for a in actual] == [e.dtype for e in expected]
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def test_dispatch_of_no_tokens_is_empty_groups() -> None:
    none = torch.zeros(0, dtype=torch.int64)
    inputs, position, ends = fused.dispatch_sorted(torch.zeros(0, 8), none, none, 2, 6)
    assert inputs.shape == (0, 8) and position.shape == (0,) and torch.equal(ends, torch.zeros(6, dtype=torch.int32))


@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (40, 4), (16, 1)])
def test_route_picks_the_routers_experts_and_weights(experts: int, top_k: int) -> None:
    """``moe.Router``'s eager selection (sigmoid, the correction bias picks, the chosen scores renormalized):
    the same experts per token (the fused kernel lists them best first), the same weights for each."""
    logits = random(6, experts, seed=7, scale=3.0).to(torch.bfloat16)
    bias = random(experts, seed=8, scale=0.5)
    scores = torch.sigmoid(logits.float())
    expected_ids = torch.topk(scores + bias, top_k, dim=-1).indices
    expected_weights = scores.gather(1, expected_ids)
    expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    ids, weights = fused.route(logits, bias, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)  # topk sorted: best first, as the kernel lists them
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_route_refuses_more_experts_than_there_are() -> None:
    with pytest.raises(ValueError, match="top-9 of 8"):
        fused.route(torch.zeros(2, 8), torch.zeros(8), 9)
