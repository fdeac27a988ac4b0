"""Expert-parallel MoE on one GPU: every rank's bf16 shard of a MoE layer, captured in a CUDA graph (capture
fails at any host sync), replayed on new tokens, adds up to the single-GPU layer's routed sum; one replay routes
no pair to rank 1.  The same sums on CPU: tests/engine/distributed/test_expert_parallel_moe.py.
"""

import pytest
import torch

from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from tests.engine.distributed.test_expert_parallel_moe import expert_parallel_moes


@pytest.mark.parametrize("num_tokens", [24, 512])
def test_expert_parallel_shards_replay_in_cuda_graphs(num_tokens):
    full, shards = expert_parallel_moes(ensure_tiny_checkpoint(), 2, "cuda", torch.bfloat16)
    hidden = full.gate_up_proj.shape[2]
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    expert_ids = torch.zeros(num_tokens, 2, dtype=torch.int64, device="cuda")
    weights = torch.zeros(num_tokens, 2, dtype=torch.float32, device="cuda")
    graphs, outputs = [], []
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: first calls allocate and pick kernels
            for shard in shards:
                shard._experts(x, expert_ids, weights)
        torch.cuda.current_stream().wait_stream(stream)
        for shard in shards:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs.append(shard._experts(x, expert_ids, weights))
            graphs.append(graph)
        generator = torch.Generator(device="cuda").manual_seed(9)
        routed_elsewhere = torch.tensor([[0, 1]], device="cuda").expand(num_tokens, 2)  # experts of rank 0 only
        for routing in ("router", "rank 0 only"):
            x.copy_(torch.randn(num_tokens, hidden, generator=generator, device="cuda"))
            ids, w = full.router(x)
            if routing == "rank 0 only":
                ids = routed_elsewhere
            expert_ids.copy_(ids)
            weights.copy_(w)
            for graph in graphs:
                graph.replay()
            expected = full._experts(x, expert_ids, weights)
            torch.testing.assert_close(outputs[0] + outputs[1], expected, rtol=2e-2, atol=2e-2, msg=routing)
            if routing == "rank 0 only":
                assert torch.equal(outputs[1], torch.zeros_like(outputs[1]))
