"""MoE expert paths: the grouped-GEMM path (bf16 on CUDA in serving) equals the per-expert loop."""

import copy

import pytest
import torch

from m3stack.engine.model.loader import load_model
from m3stack.engine.model.moe import MoE


@pytest.fixture(scope="module")
def moe(tiny_model_dir) -> MoE:
    model, _ = load_model(tiny_model_dir)
    return next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_looped_expert_paths_agree(moe, dtype):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(37, moe.gate_up_proj.shape[2], generator=generator)
    with torch.inference_mode():
        expert_ids, _ = moe.router(x)
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        inputs = x[order // expert_ids.shape[1]]
        experts = copy.deepcopy(moe).to(dtype)
        looped = experts._looped(inputs.to(dtype), flat)
        grouped = experts._grouped(inputs.to(dtype), flat)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=tolerance, atol=tolerance)


def test_experts_without_tokens_are_empty_groups(moe):
    x = torch.randn(3, moe.gate_up_proj.shape[2])
    flat = torch.tensor([0, 0, 3])  # experts 1 and 2 get nothing
    with torch.inference_mode():
        torch.testing.assert_close(moe._grouped(x, flat), moe._looped(x, flat), rtol=1e-5, atol=1e-5)
