"""Expert-parallel MoE routing on one GPU, at one rank's share of M3 at TP=8, and the MoE combine kernel.

M3's MoE: hidden 6144, 128 experts of 3072 intermediate rows, top-8.  With ``--expert-parallel`` at TP=8 a rank
holds 16 whole experts and runs the pairs routed to them:

* ``on_device`` (what ``ShardedMoE`` runs): every (token, slot) pair goes through the sort, other ranks' pairs
  take a skip id (no host sync: what CUDA graphs capture), so the row traffic is the whole batch's;
* ``compact``, the peer: this rank's pairs found on the host (one sync) and only they gathered, computed and
  scattered back, row traffic in proportion to the rank's share (what the engine ran before device routing);
* the other layout, tensor-parallel experts (all 128 experts, 384 rows each): the same GEMM work per rank;
* the combine alone (each token's weighted sum of its experts' rows, ``[tokens x 8, 6144]`` bf16 rows): the
  fused kernel the MoE runs against its torch twin (unpermute, upcast, scale, sum).

Router ids come from a random router on random inputs (near-uniform load: each rank owns ~1/8 of the pairs).
Times are CUDA-event medians (``triton.testing.do_bench``; the compact route's host sync included); each peer's
output is checked against the measured path's once per size.

    python -m bench.moe_routing [--out DIR]
"""

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import M3_MOE, cuda_time_us, markdown_table, write_results
from m3stack.engine.distributed.layers import ShardedMoE
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.moe import MoE, combine_expert_rows, combine_expert_rows_eager

logger = logging.getLogger("bench.moe_routing")

WORLD = 8
TOKENS = [16, 64, 128, 256, 512, 1024, 4096, 8192]
COLUMNS = [
    "tokens",
    "on_device_us",
    "compact_us",
    "compact_over_on_device",
    "tp_experts_us",
    "combine_us",
    "combine_eager_us",
    "eager_over_fused",
]


def rank_moe(expert_parallel: bool) -> ShardedMoE:
    """Rank 0's MoE of M3 at TP=8, random bf16 weights (the router is the full one either way)."""
    text = parse_config({"model_type": "minimax_m3_vl", "text_config": M3_MOE, "vision_config": {}}).text
    experts = range(text.num_experts // WORLD) if expert_parallel else range(text.num_experts)
    rows = text.moe_intermediate_size if expert_parallel else text.moe_intermediate_size // WORLD
    moe = ShardedMoE(text, experts=experts, expert_rows=rows, shared_rows=text.shared_intermediate_size // WORLD,
                     dtype=torch.bfloat16, device="cuda")  # fmt: skip
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for parameter in moe.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
            parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cuda") / fan_in**0.5)
        moe.router.correction_bias.zero_()
    return moe


def compact_experts(moe: ShardedMoE, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The peer route: only this rank's pairs, found with ``nonzero`` (a host sync), through the single-GPU
    MoE's expert path, scattered into ``[T, k, H]`` float32 and summed over slots."""
    num_tokens, top_k = expert_ids.shape
    local = (expert_ids >= moe.experts.start) & (expert_ids < moe.experts.stop)
    tokens, slots = local.nonzero(as_tuple=True)
    pairs = torch.zeros((num_tokens, top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    if tokens.numel():
        local_ids = (expert_ids[tokens, slots] - moe.experts.start)[:, None]
        pairs[tokens, slots] = MoE._experts(moe, x[tokens], local_ids, weights[tokens, slots][:, None])
    return pairs.sum(dim=1)


def measure(tokens: int, expert_parallel: ShardedMoE, tensor_parallel: ShardedMoE) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, M3_MOE["hidden_size"], generator=generator, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        expert_ids, weights = expert_parallel.router(x)
        on_device = expert_parallel._experts(x, expert_ids, weights)
        compact = compact_experts(expert_parallel, x, expert_ids, weights)
        torch.testing.assert_close(compact, on_device, rtol=2e-2, atol=2e-2)
        times = {
            "on_device_us": cuda_time_us(lambda: expert_parallel._experts(x, expert_ids, weights)),
            "compact_us": cuda_time_us(lambda: compact_experts(expert_parallel, x, expert_ids, weights)),
            "tp_experts_us": cuda_time_us(lambda: tensor_parallel._experts(x, expert_ids, weights)),
        }
        rows = torch.randn(expert_ids.numel(), x.shape[1], generator=generator, device="cuda").to(torch.bfloat16)
        # Each pair's row in expert order (the inverse of the stable sort's order), as the dispatch hands it over.
        position = torch.argsort(torch.argsort(expert_ids.flatten(), stable=True))
        owned = torch.tensor(rows.shape[0], device="cuda")
        fused = combine_expert_rows(rows, position, weights, owned)
        torch.testing.assert_close(fused, combine_expert_rows_eager(rows, position, weights, owned))
        times["combine_us"] = cuda_time_us(lambda: combine_expert_rows(rows, position, weights, owned))
        times["combine_eager_us"] = cuda_time_us(lambda: combine_expert_rows_eager(rows, position, weights, owned))
    row = {
        "tokens": tokens,
        **times,
        "compact_over_on_device": times["compact_us"] / times["on_device_us"],
        "eager_over_fused": times["combine_eager_us"] / times["combine_us"],
    }
    logger.info("%d tokens: %s", tokens, row)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for moe_routing.json (default bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    expert_parallel, tensor_parallel = rank_moe(expert_parallel=True), rank_moe(expert_parallel=False)
    rows = [measure(tokens, expert_parallel, tensor_parallel) for tokens in TOKENS]
    extra = {"shape": "M3 MoE at TP=8, rank 0: 16 whole experts (expert-parallel) or 128 x 384 rows (tensor-parallel)"}
    write_results("moe_routing", rows, extra, args.out)
    sys.stdout.write(markdown_table(rows, COLUMNS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
