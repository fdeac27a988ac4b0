"""A/B of the MXFP8 kernels' K split on the H200: M3's 1-row dense linears at the plan's split against 1, 2 and 6
splits (graphs of many calls, ``do_bench_cudagraph``), and M3's MoE layer at 1 and 4 tokens with the plan's
splits against none.  This run set ``mxfp8_kernels.MIN_PROGRAMS_PER_SM`` from 2 to 4 (commit 22dff22); its output
is ``bench/results/mxfp8_split_ab.json``.

    python -m bench.mxfp8_split_ab [--out DIR]
"""

import argparse
import dataclasses
import functools
import logging
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from bench.common import cuda_time_us, graphed, write_results
from bench.mxfp8_linears import LINEARS
from bench.mxfp8_moe import layers, step, step_input, whole_layer
from m3stack.engine.model import mxfp8, mxfp8_kernels

logger = logging.getLogger("bench.mxfp8_split_ab")


def linear_rows() -> list[dict[str, object]]:
    rows = []
    for name, (n, k) in LINEARS.items():
        values, scales = mxfp8.quantize(torch.randn(n, k, device="cuda") / k**0.5)
        scales = mxfp8.block_major(scales)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        plan = mxfp8_kernels.plan_launch(1, n, k, None, x.device)
        row: dict[str, object] = {"linear": name, "split": plan.split}
        for split in (plan.split, 1, 2, 6):
            tiles = dataclasses.replace(plan.tiles, split_k=split)
            call = functools.partial(mxfp8_kernels.mxfp8_linear, x, values, scales, tiles)
            row[f"split{split}_us"] = do_bench_cudagraph(call) * 1e3
        logger.info("%s", row)
        rows.append(row)
    return rows


def layer_rows() -> list[dict[str, object]]:
    bf16, quantized = layers(whole_layer)
    rows = []
    for tokens in (1, 4):
        x = step_input(tokens)
        with torch.inference_mode():
            row: dict[str, object] = {"tokens": tokens, "bf16_us": cuda_time_us(graphed(lambda: step(bf16, x)))}  # noqa: B023
            row["mxfp8_us"] = cuda_time_us(graphed(lambda: step(quantized, x)))  # noqa: B023
            saved, mxfp8_kernels.MIN_PROGRAMS_PER_SM = mxfp8_kernels.MIN_PROGRAMS_PER_SM, 0  # no split anywhere
            try:
                row["mxfp8_unsplit_us"] = cuda_time_us(graphed(lambda: step(quantized, x)))  # noqa: B023
            finally:
                mxfp8_kernels.MIN_PROGRAMS_PER_SM = saved
        logger.info("%s", row)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for mxfp8_split_ab.json (default bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    write_results("mxfp8_split_ab", linear_rows(), {"layer": layer_rows()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
