"""The fused decoder kernels on the GPU at M3 sizes against the eager torch ops they replace, on the same GPU."""

import pytest
import torch

from m3stack.engine.model import fused, moe
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.mlp import swiglu_oai
from m3stack.engine.model.norm import gemma_rms_norm
from m3stack.engine.model.rope import apply_rotary, inverse_frequencies, text_cos_sin

DEVICE = "cuda"


def random(*shape: int, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device=DEVICE) * scale).to(torch.bfloat16)


def differing(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    return (actual != expected).float().mean().item()


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_norms_and_swiglu_equal_eager_bf16(num_tokens: int) -> None:
    x, residual = random(num_tokens, 6144, seed=1, scale=2.0), random(num_tokens, 6144, seed=2, scale=20.0)
    weight = random(6144, seed=3, scale=0.3)
    # The sum of squares adds in another order than torch's reduction: a rare last-bit difference.
    assert differing(fused.rms_norm(x, weight, 1e-6), gemma_rms_norm(x, weight, 1e-6)) < 1e-3
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert differing(normed, gemma_rms_norm(x + residual, weight, 1e-6)) < 1e-3
    gate_up = random(num_tokens, 2 * 12288, seed=4, scale=6.0)
    assert differing(fused.swiglu_oai(gate_up, 1.702, 7.0), swiglu_oai(gate_up, 1.702, 7.0)) < 1e-4


@pytest.mark.parametrize("num_tokens", [1, 8192])
def test_head_norm_rope_equals_eager_bf16_on_projection_slices(num_tokens: int) -> None:
    # The fused projection of an MSA layer: q (64 x 128), k, v (4 x 128), index q (4 x 128), index k (128).
    projection = random(num_tokens, 64 * 128 + 3 * 512 + 128, seed=5, scale=2.0)
    q = projection[:, : 64 * 128].view(num_tokens, 64, 128)
    index_k = projection[:, -128:].view(num_tokens, 1, 128)
    positions = torch.randint(0, 1 << 20, (num_tokens,), device=DEVICE)
    cos, sin = text_cos_sin(positions, inverse_frequencies(64, 5e6), torch.bfloat16)
    for x, seed in ((q, 6), (index_k, 7)):
        weight = random(128, seed=seed, scale=0.3)
        expected = apply_rotary(gemma_rms_norm(x, weight, 1e-6), cos, sin)
        assert differing(fused.head_norm_rope(x, weight, cos, sin, 1e-6), expected) < 1e-3


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_route_picks_the_eager_routers_experts(num_tokens: int) -> None:
    """M3's router (128 experts, top-8) from bf16 logits: the experts torch.topk picks (as sets: ties in bf16
    logits may order them apart) and the same weights within float32 rounding."""
    logits = random(num_tokens, 128, seed=7, scale=3.0)
    bias = random(128, seed=8, scale=0.1).float()
    scores = torch.sigmoid(logits.float())
    expected = torch.topk(scores + bias, 8, dim=-1).indices
    ids, weights = fused.route(logits, bias, 8)
    same_sets = (ids.sort(dim=-1).values == expected.sort(dim=-1).values).all(dim=-1)
    assert same_sets.float().mean().item() > 0.999  # exact ties at the 8th place may swap one expert
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(dim=-1, keepdim=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_dispatch_equals_the_sort_and_the_eager_gather_scatter_and_search(num_tokens: int) -> None:
    """M3's dispatch (bf16 tokens of 6144, 128 experts, top-8) as one rank of expert parallelism sees it, a fifth of
    the pairs another rank's (skip id 128): the same rows, positions and end rows as ``torch.sort`` then the eager
    ops, whether the kernel ranks the pairs (1, 64 tokens) or sorts first (8192)."""
    x = random(num_tokens, 6144, seed=7, scale=2.0)
    generator = torch.Generator(device=DEVICE).manual_seed(8)
    ids = torch.randint(0, 128, (num_tokens, 8), generator=generator, device=DEVICE)
    ids.view(-1)[::5] = 128
    actual = fused.dispatch(x, ids, 128)
    row_ids, order = torch.sort(ids.flatten(), stable=True)
    expected = moe.dispatch_sorted_eager(x, row_ids, order, 8, 128)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_combine_sums_and_finishes_the_layer_as_the_eager_ops(num_tokens: int) -> None:
    """The combine of M3's expert rows (bf16 ``[T x 8, 6144]``): float32 sums equal to the eager gather, scale and
    sum's within summation order, and, given the shared output, the layer's output equal bit for bit to the eager
    ``(sums * scale).to(bf16) + shared`` of its own sums.  Rows no GEMM ran hold NaN and add zero."""
    generator = torch.Generator(device=DEVICE).manual_seed(9)
    position = torch.randperm(num_tokens * 8, generator=generator, device=DEVICE)
    owned = torch.tensor(num_tokens * 8 * 4 // 5, device=DEVICE)  # the rest: another rank's pairs
    rows = random(num_tokens * 8, 6144, seed=10, scale=2.0)
    rows[int(owned) :] = float("nan")
    weights = torch.rand(num_tokens, 8, generator=generator, device=DEVICE)
    sums = fused.combine_expert_rows(rows, position, weights, owned)
    torch.testing.assert_close(sums, moe.combine_expert_rows_eager(rows, position, weights, owned))
    finish = moe.Finish(1.3, random(num_tokens, 6144, seed=12, scale=4.0))
    out = fused.combine_expert_rows(rows, position, weights, owned, finish.scale, finish.shared)
    assert not out.isnan().any() and torch.equal(out, finish.apply(sums))


@pytest.fixture(scope="module")
def m3_moe() -> moe.MoE:
    """M3's MoE layer shape (hidden 6144, 128 experts, top-8, a shared expert) with 256 rows an expert (to stay
    small) and a routed scaling of 2.5 (its products round), random bf16 weights."""
    text = parse_config({"model_type": "minimax_m3_vl", "text_config": {
        "hidden_size": 6144, "intermediate_size": 256, "shared_intermediate_size": 256, "num_local_experts": 128,
        "num_experts_per_tok": 8, "routed_scaling_factor": 2.5}}).text  # fmt: skip
    layer = moe.MoE(text, dtype=torch.bfloat16, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(14)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, parameter.shape[-1] ** -0.5, generator=generator)
        layer.router.correction_bias.zero_()
    return layer


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_moe_layer_equals_its_eager_ops(m3_moe: moe.MoE, num_tokens: int) -> None:
    """The layer's forward (fused dispatch, then combine and finish, around torch's grouped GEMMs), eagerly and
    replayed from a CUDA graph, against the eager ops on the same routing and GEMMs: only the float32 sums' order
    may move an output by a bf16 step."""
    x = random(num_tokens, 6144, seed=13, scale=1.0)
    with torch.inference_mode():
        out = m3_moe(x)
        ids, weights = m3_moe.router(x)
        row_ids, order = torch.sort(ids.flatten(), stable=True)
        inputs, position, ends = moe.dispatch_sorted_eager(x, row_ids, order, 8, 128)
        sums = moe.combine_expert_rows_eager(m3_moe._grouped(inputs, ends), position, weights, ends[-1])
        expected = moe.Finish(m3_moe.routed_scaling_factor, m3_moe.shared_expert(x)).apply(sums)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = m3_moe(x)
        graph.replay()
    assert differing(out, expected) < 1e-3
    assert torch.equal(captured, out)


def test_moe_layer_waits_for_its_shared_expert_on_the_side_stream(m3_moe: moe.MoE, monkeypatch) -> None:
    """The shared expert runs on a side stream beside the routed experts; held back there for ~25 ms, the layer's
    output is still the same: the combine waits for it."""
    x = random(64, 6144, seed=15, scale=1.0)
    main = torch.cuda.current_stream()
    streams = []
    original = m3_moe.shared_expert.forward

    def slow_shared_expert(inputs: torch.Tensor) -> torch.Tensor:
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)  # GPU clock cycles, on the stream it runs on
        return original(inputs)

    with torch.inference_mode():
        expected = m3_moe(x)
        monkeypatch.setattr(m3_moe.shared_expert, "forward", slow_shared_expert)
        out = m3_moe(x)
    assert streams and streams[0] != main
    assert torch.equal(out, expected)
