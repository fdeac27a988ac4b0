"""MoE expert paths: the grouped-GEMM path (bf16 on CUDA in serving) and every-expert path (other dtypes on CUDA)
equal the per-expert loop, and the path a CUDA step takes never reads a device value on the host."""

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from m3stack.engine.model.loader import load_model
from m3stack.engine.model.moe import MoE, dispatch


@pytest.fixture(scope="module")
def moe(tiny_model_dir) -> MoE:
    model, _ = load_model(tiny_model_dir)
    return next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))


def end_rows(moe: MoE, row_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Each expert's end row in the sorted ``row_ids`` (the first row past its group), as the expert paths take
    them."""
    experts = torch.arange(moe.gate_up_proj.shape[0])
    return torch.searchsorted(torch.as_tensor(row_ids), experts, right=True, out_int32=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_every_expert_and_looped_paths_agree(moe, dtype):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(37, moe.gate_up_proj.shape[2], generator=generator)
    with torch.inference_mode():
        expert_ids, _ = moe.router(x)
        inputs, _, ends = dispatch(x.to(dtype), expert_ids, moe.gate_up_proj.shape[0])
        experts = copy.deepcopy(moe).to(dtype)
        looped = experts._looped(inputs, ends)
        grouped = experts._grouped(inputs, ends)
        every = experts._every_expert(inputs, ends)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(every.float(), looped.float(), rtol=tolerance, atol=tolerance)


def test_experts_without_tokens_are_empty_groups(moe):
    x = torch.randn(3, moe.gate_up_proj.shape[2])
    ends = end_rows(moe, [0, 0, 3])  # experts 1 and 2 get nothing
    with torch.inference_mode():
        looped = moe._looped(x, ends)
        torch.testing.assert_close(moe._grouped(x, ends), looped, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moe._every_expert(x, ends), looped, rtol=1e-5, atol=1e-5)


def test_every_expert_path_leaves_other_ranks_rows_zero(moe):
    """An id past the last expert marks a pair another rank runs (expert parallelism): its row adds zero."""
    x = torch.randn(3, moe.gate_up_proj.shape[2])
    skip = moe.gate_up_proj.shape[0]
    with torch.inference_mode():
        out = moe._every_expert(x, end_rows(moe, [1, skip, skip]))
    assert torch.equal(out[1:], torch.zeros_like(out[1:])) and bool(out[0].abs().sum() > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_expert_path_of_a_cuda_step_reads_no_device_value_on_the_host(moe, dtype):
    """A decode step on CUDA is captured in a CUDA graph, where a device value read on the host fails (the float32
    engine's capture on the H200: the loop's ``torch.bincount``, as it was, copied the ids' minimum to pageable
    memory, 'Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned').
    Fake tensors carry shapes, not values: any value-dependent step (``bincount``, ``tolist``, ``item``) raises
    under them.  The path is chosen for CUDA activations (a fake CUDA tensor) and run here on CPU tensors."""
    experts = copy.deepcopy(moe).to(dtype)
    hidden = experts.gate_up_proj.shape[2]
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        path = experts.expert_path(torch.empty(1, hidden, dtype=dtype, device="cuda"))
        row_ids = torch.randint(0, experts.gate_up_proj.shape[0], (48,)).sort().values
        out = path(torch.randn(48, hidden, dtype=dtype), end_rows(experts, row_ids))
    assert path != experts._looped and tuple(out.shape) == (48, experts.down_proj.shape[1])


def test_forward_finishes_the_routed_sum_and_experts_still_return_sums(moe):
    """The layer is ``(routed * routed_scaling_factor).to(x.dtype) + shared``, applied by the combine within
    ``forward``; ``_experts`` called on its own (expert-parallel partial sums, benchmarks) stays float32."""
    layer = copy.deepcopy(moe).to(torch.bfloat16)
    x = torch.randn(9, layer.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        expert_ids, weights = layer.router(x)
        routed = layer._experts(x, expert_ids, weights)
        expected = (routed * layer.routed_scaling_factor).to(x.dtype) + layer.shared_expert(x)
    assert routed.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
