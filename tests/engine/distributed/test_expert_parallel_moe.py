"""Expert-parallel MoE: each rank runs only the (token, slot) pairs of its own experts, routed on the device
(other ranks' pairs take a skip id), with no step whose shape depends on values: no host sync, so decode steps
can be CUDA-graphed.

The ranks' routed partial sums (what the layer's all-reduce adds up) equal the single-GPU layer's routed sum on
both expert paths (per-expert loop, grouped GEMM), including a step in which a rank owns no pair.  The grouped
GEMM leaves the rows past its last group unwritten; here they are poisoned with NaN, as stale memory would be on
a GPU, and must not leak.  Fake tensors (shapes, no values: any value-dependent step raises) show there is no
sync.  tests/gpu/test_expert_parallel.py replays the shards in CUDA graphs.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from m3stack.engine.distributed.layers import ShardedMoE
from m3stack.engine.distributed.model import load_sharded_model
from m3stack.engine.distributed.sharding import plan_shards
from m3stack.engine.model import moe as moe_module
from m3stack.engine.model.loader import load_model
from m3stack.engine.model.moe import MoE


def moe_layer(model) -> MoE:
    return next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))


def expert_parallel_moes(model_dir, world: int, device: str, dtype: torch.dtype) -> tuple[MoE, list[ShardedMoE]]:
    """The single-GPU model's first MoE layer and every rank's expert-parallel shard of it."""
    full, config = load_model(model_dir, device, dtype)
    shards = []
    for rank in range(world):
        plan = plan_shards(config.text, world, rank, expert_parallel=True)
        shard, _ = load_sharded_model(model_dir, plan, device, dtype)
        shards.append(moe_layer(shard))
    return moe_layer(full), shards


def _poisoned_grouped_mm(inputs: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = moe_module.grouped_mm.__wrapped__(inputs, weights, offsets)  # type: ignore[attr-defined]
    rows = torch.arange(out.shape[0])
    return torch.where((rows >= offsets[-1])[:, None], float("nan"), out)


@pytest.fixture(params=["looped", "grouped"])
def expert_path(request, monkeypatch) -> str:
    if request.param == "grouped":  # the serving path (bf16 on CUDA), here on CPU, with poisoned spare rows
        original = moe_module.grouped_mm
        poisoned = _poisoned_grouped_mm
        poisoned.__wrapped__ = original  # type: ignore[attr-defined]
        monkeypatch.setattr(moe_module, "grouped_mm", poisoned)
        monkeypatch.setattr(moe_module, "use_grouped_mm", lambda x: True)
    return request.param


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_partial_sums_add_up_to_the_single_gpu_layer(tiny_model_dir, expert_path, world):
    full, shards = expert_parallel_moes(tiny_model_dir, world, "cpu", torch.float32)
    x = torch.randn(37, full.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        expert_ids, weights = full.router(x)
        partials = [shard._experts(x, expert_ids, weights) for shard in shards]
        expected = full._experts(x, expert_ids, weights)
    torch.testing.assert_close(torch.stack(partials).sum(dim=0), expected)


def test_a_rank_without_pairs_adds_zero(tiny_model_dir, expert_path):
    """One token routed to experts 0 and 1 only: rank 1 of 2 (experts 2 and 3) owns none of its pairs."""
    full, shards = expert_parallel_moes(tiny_model_dir, 2, "cpu", torch.float32)
    x = torch.randn(1, full.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(3))
    expert_ids, weights = torch.tensor([[1, 0]]), torch.tensor([[0.75, 0.25]])
    with torch.inference_mode():
        idle = shards[1]._experts(x, expert_ids, weights)
        busy = shards[0]._experts(x, expert_ids, weights)
        expected = full._experts(x, expert_ids, weights)
    assert torch.equal(idle, torch.zeros_like(idle))
    torch.testing.assert_close(busy, expected)


def test_routing_never_needs_device_values_on_the_host(tiny_model_dir, monkeypatch):
    """Fake tensors carry shapes, not values: a step whose output shape depends on values (``nonzero``,
    ``tolist``, ``item``; on a GPU a host sync, and an error inside CUDA-graph capture) raises under them."""
    monkeypatch.setattr(moe_module, "use_grouped_mm", lambda x: True)
    full, shards = expert_parallel_moes(tiny_model_dir, 2, "cpu", torch.bfloat16)
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(600, full.gate_up_proj.shape[2], dtype=torch.bfloat16)
        expert_ids, weights = full.router(x)
        partials = [shard._experts(x, expert_ids, weights) for shard in shards]
    assert [tuple(p.shape) for p in partials] == [(600, full.gate_up_proj.shape[2])] * 2
