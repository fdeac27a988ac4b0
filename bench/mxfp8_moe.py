"""M3's MoE layer with MXFP8 weights against the same layer in BF16, on one GPU, in the same run.

The layer is the whole of one M3 MoE layer (hidden 6144, 128 experts of 3072 rows, top-8, one 3072-row shared
expert, the router), as ``engine.model.moe.MoE`` runs it: BF16 through torch's grouped GEMM; MXFP8 by both of its
paths, ``fused`` (``mxfp8_kernels``' grouped GEMM: FP8 weights and E8M0 scales widened in registers, bf16 MMAs)
and ``dequant`` (``MoE.grouped_dequantized``: experts widened into a bf16 scratch a chunk at a time, torch's
grouped GEMM).  Also one TP=8 rank's share with expert parallelism (16 whole experts, 384 rows of the shared
expert).  The layers hold the same random weights (the MXFP8 one quantized from the BF16 one), and the router sees
the same random tokens, so all run the same experts.

* Decode steps (1-64 tokens) are timed as CUDA graphs of the layer (decode runs graphed), prefill-sized steps
  eagerly; the dequant path always eagerly (it syncs once a step, so the engine never graphs it).  CUDA-event
  medians (``triton.testing.do_bench``).
* ``*_speedup``: the BF16 layer's time over the path's.  ``default``: the path
  ``mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT`` picks at that size; the ``crossover`` line says from which measured size
  on ``dequant`` wins at every larger one, and its rows an expert (the value that constant should take).
* ``*_tbps``: the weight bytes the step must read (the experts its tokens route to, the shared expert and the
  router) over its time, against the H200's measured 4.27 TB/s copy ceiling (``../shared/gpu/README.md``).
* After timing, each size checks both MXFP8 paths against the BF16 layer holding the dequantized weights
  (relative error of the outputs, ``*_err``).
* ``--budget-s`` bounds the timed sizes (the ones past it are left out, logged).  The grouped GEMM alone over
  launch configurations is ``bench.mxfp8_gemv``'s (``--tokens``, ``--tiles``).

    python -m bench.mxfp8_moe [--out DIR] [--budget-s S] [--tokens 1,2,...] [--rank-tokens 1,...]
"""

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import M3_MOE, cuda_time_us, graphed, int_list, markdown_table, write_results
from m3stack.engine.distributed.layers import ShardedMoE
from m3stack.engine.model import mxfp8
from m3stack.engine.model.config import TextConfig, parse_config
from m3stack.engine.model.moe import MoE

logger = logging.getLogger("bench.mxfp8_moe")

COPY_CEILING_TBPS = 4.27
DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_TOKENS = [512, 2048, 8192]
RANK_TOKENS = [1, 8, 64, 8192]
COLUMNS = ["layer", "tokens", "rows_per_expert", "experts_run", "bf16_us", "fused_us", "dequant_us", "fused_speedup",
           "dequant_speedup", "default", "bf16_tbps", "fused_tbps", "fused_ceiling", "fused_err",
           "dequant_err"]  # fmt: skip
PATHS = {"fused": math.inf, "dequant": 0.0}  # MoE.dequantize_from_rows (rows an expert) for each
TIMING = {"warmup_ms": 10, "rep_ms": 60}  # short medians: the stage has a minute for ~40 timings


M3_TEXT: TextConfig = parse_config({"model_type": "minimax_m3_vl", "text_config": M3_MOE}).text
RANK_EXPERTS = range(16)  # one TP=8 rank's experts under --expert-parallel


def whole_layer(device: str) -> MoE:
    return MoE(M3_TEXT, dtype=torch.bfloat16, device=device)


def ep_rank(device: str) -> ShardedMoE:
    """Rank 0 of 8 with expert parallelism: 16 whole experts, 384 of the shared expert's rows, the full router."""
    shared_rows = M3_TEXT.shared_intermediate_size // 8
    return ShardedMoE(M3_TEXT, experts=RANK_EXPERTS, expert_rows=M3_TEXT.moe_intermediate_size,
                      shared_rows=shared_rows, dtype=torch.bfloat16, device=device)  # fmt: skip


def step(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward without the all-reduce a sharded layer adds (one GPU has no peers): ``MoE.forward``,
    which a ``ShardedMoE`` runs with its own expert routing (other ranks' pairs skipped on the device)."""
    return MoE.forward(layer, x)


def layers(build) -> tuple[MoE, MoE]:
    """A BF16 layer with random weights and its MXFP8 twin (weights quantized from it), on the GPU."""
    bf16 = build("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for parameter in bf16.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
            parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cuda") / fan_in**0.5)
        bf16.router.correction_bias.zero_()
    quantized = build("meta")
    names = ["gate_up_proj", "down_proj", "shared_expert.gate_up_proj.weight", "shared_expert.down_proj.weight"]
    mxfp8.quantize_parameters(quantized, names)
    quantized.to_empty(device="cuda")
    params, source = dict(quantized.named_parameters()), dict(bf16.named_parameters())
    with torch.no_grad():
        for name, parameter in params.items():
            if name.endswith("_scale_inv"):
                continue
            if name in names:
                for row in range(source[name].shape[0]):  # one expert (or 1024 rows) at a time: float32 temporaries
                    values, scales = mxfp8.quantize(source[name][row])
                    parameter[row], params[name + "_scale_inv"][row] = values, scales
            else:
                parameter.copy_(source[name])
    return bf16, quantized


def dequantize_into(bf16: MoE, quantized: MoE) -> None:
    """Give the BF16 layer the MXFP8 layer's weights, dequantized: the reference of the correctness check."""
    params, target = dict(quantized.named_parameters()), dict(bf16.named_parameters())
    with torch.no_grad():
        for name, parameter in params.items():
            if mxfp8.is_quantized(parameter):
                for row in range(parameter.shape[0]):
                    scales = params[name + "_scale_inv"][row]
                    target[name][row] = mxfp8.dequantize(parameter[row], scales, torch.bfloat16)


def experts_run(layer: MoE, expert_ids: torch.Tensor) -> int:
    """How many of the layer's own experts the step's tokens route to."""
    first = layer.experts.start if isinstance(layer, ShardedMoE) else 0
    local = expert_ids - first
    return int(torch.unique(local[(local >= 0) & (local < layer.gate_up_proj.shape[0])]).numel())


def weight_bytes(layer: MoE, expert_ids: torch.Tensor) -> int:
    """Bytes of weights one step reads: the experts its tokens route to, the shared expert, the router."""
    params = dict(layer.named_parameters())
    run = experts_run(layer, expert_ids)
    per_expert = sum(params[n][0].numel() * params[n].element_size() for n in params if n.count(".") == 0)
    shared = sum(p.numel() * p.element_size() for n, p in params.items() if n.startswith("shared_expert."))
    router = params["router.weight"].numel() * params["router.weight"].element_size()
    return run * per_expert + shared + router


def step_input(tokens: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    return torch.randn(tokens, M3_MOE["hidden_size"], generator=generator, device="cuda", dtype=torch.bfloat16)


def measure(name: str, bf16: MoE, quantized: MoE, tokens: int) -> dict[str, Any]:
    """One step size: the BF16 layer and both MXFP8 paths, timed."""
    x = step_input(tokens)
    decode = tokens <= max(DECODE_TOKENS)
    with torch.inference_mode():
        expert_ids, _ = bf16.router(x)
        times = {"bf16": cuda_time_us(graphed(lambda: step(bf16, x)) if decode else lambda: step(bf16, x), **TIMING)}
        for path, threshold in PATHS.items():
            quantized.dequantize_from_rows = threshold
            call = lambda: step(quantized, x)  # noqa: E731
            times[path] = cuda_time_us(graphed(call) if decode and path == "fused" else call, **TIMING)
        quantized.dequantize_from_rows = mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT
    row: dict[str, Any] = {"layer": name, "tokens": tokens, "experts_run": experts_run(bf16, expert_ids)}
    row.update(bf16_us=times["bf16"], fused_us=times["fused"], dequant_us=times["dequant"])
    row.update(fused_speedup=times["bf16"] / times["fused"], dequant_speedup=times["bf16"] / times["dequant"])
    row["rows_per_expert"] = tokens * M3_MOE["num_experts_per_tok"] / M3_MOE["num_local_experts"]
    row["default"] = "dequant" if row["rows_per_expert"] >= mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT else "fused"
    row["bf16_tbps"] = weight_bytes(bf16, expert_ids) / times["bf16"] / 1e6
    row["fused_tbps"] = weight_bytes(quantized, expert_ids) / times["fused"] / 1e6
    row["fused_ceiling"] = row["fused_tbps"] / COPY_CEILING_TBPS
    logger.info("%s", row)
    return row


def check(bf16: MoE, quantized: MoE, rows: list[dict[str, Any]]) -> None:
    """Each size's output by both MXFP8 paths against the BF16 layer of the dequantized weights (after timing)."""
    dequantize_into(bf16, quantized)
    for row in rows:
        x = step_input(row["tokens"])
        with torch.inference_mode():
            reference = step(bf16, x).float()
            for path, threshold in PATHS.items():
                quantized.dequantize_from_rows = threshold
                ours = step(quantized, x).float()
                row[f"{path}_err"] = float((ours - reference).norm() / reference.norm())
        quantized.dequantize_from_rows = mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT
        if not max(row["fused_err"], row["dequant_err"]) < 2e-2:  # bf16 rounding gives ~5e-3
            logger.error("MXFP8 layer differs from its dequantized BF16 twin: %s", row)


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The smallest measured step size from which the dequant path beats the fused one at every larger size."""
    best = None
    for row in sorted(rows, key=lambda r: -r["tokens"]):
        if row["dequant_us"] >= row["fused_us"]:
            break
        best = row["tokens"]
    return best


def timed_sizes(name: str, pair: tuple[MoE, MoE], sizes: list[int], budget_end: float) -> list[dict[str, Any]]:
    """``measure`` at each size while the budget lasts, then ``check`` the sizes measured."""
    rows = []
    for tokens in sizes:
        if time.monotonic() > budget_end:
            logger.warning("%s: sizes from %d tokens on left out by --budget-s", name, tokens)
            break
        rows.append(measure(name, *pair, tokens))
    check(*pair, rows)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for mxfp8_moe.json (default bench/results)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="time no new size past this")
    parser.add_argument("--tokens", type=int_list, default=DECODE_TOKENS + PREFILL_TOKENS, help="whole layer's steps")
    parser.add_argument("--rank-tokens", type=int_list, default=RANK_TOKENS, help="the EP rank's steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    budget_end = time.monotonic() + args.budget_s
    whole = layers(whole_layer)
    rows = timed_sizes("whole layer", whole, args.tokens, budget_end)
    del whole
    torch.cuda.empty_cache()
    rows += timed_sizes("EP rank of 8", layers(ep_rank), args.rank_tokens, budget_end)
    crossovers = {name: crossover([r for r in rows if r["layer"] == name]) for name in ("whole layer", "EP rank of 8")}
    top_k, experts = M3_MOE["num_experts_per_tok"], M3_MOE["num_local_experts"]
    crossover_rows = {name: None if tokens is None else tokens * top_k / experts for name, tokens in crossovers.items()}
    extra = {"shape": "M3 MoE: hidden 6144, 128 experts x 3072 rows, top-8, shared expert 3072 rows",
             "copy_ceiling_tbps": COPY_CEILING_TBPS,
             "dequantize_from_rows_per_expert": mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT,
             "crossover": crossovers, "crossover_rows_per_expert": crossover_rows}  # fmt: skip
    write_results("mxfp8_moe", rows, extra, args.out)
    sys.stdout.write(markdown_table(rows, COLUMNS) + "\n")
    sys.stdout.write(
        f"crossover (dequant beats fused from this size on): {crossovers} tokens, {crossover_rows} rows an expert; "
        f"mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT = {mxfp8.DEQUANTIZE_FROM_ROWS_PER_EXPERT}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
