"""M3's dense linears with MXFP8 weights against cuBLAS's bf16 on the same dequantized weights.

The linears one TP=1 step runs outside the experts (attention's q, k|v and o projections, a dense layer's MLP,
the shared expert), each at 1, 4 and 16 rows by default (decode; ``--rows`` for others), CUDA-graphed as the engine
runs decode: ``mxfp8_kernels``' plan (``mxfp8``: its tiles and K split), the weight widened into a bf16 scratch and
cuBLAS's matmul (``dequant``), and ``torch.nn.functional.linear`` in bf16.  ``default``: the path
``mxfp8.linear`` takes at that size (``mxfp8.DENSE_KERNEL_MAX_ROWS``).  TB/s: the weight bytes the kernel
reads (FP8 + scales, or bf16) over its time, against the H200's 4.27 TB/s copy ceiling.  After timing, both MXFP8
outputs are checked against the float32 product of the dequantized weights.

    python -m bench.mxfp8_linears [--out DIR] [--rows 1,4,16]
"""

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import cuda_time_us, graphed, int_list, markdown_table, write_results
from m3stack.engine.model import mxfp8, mxfp8_kernels

logger = logging.getLogger("bench.mxfp8_linears")

COPY_CEILING_TBPS = 4.27
# (N, K) at M3's dims (hidden 6144, 64 query heads and 4 KV heads of 128, dense MLP 12288, shared expert 3072).
LINEARS = {
    "q": (8192, 6144),
    "k|v": (1024, 6144),
    "o": (6144, 8192),
    "dense gate|up": (24576, 6144),
    "dense down": (6144, 12288),
    "shared gate|up": (6144, 6144),
    "shared down": (6144, 3072),
}
COLUMNS = ["linear", "rows", "split", "bf16_us", "mxfp8_us", "dequant_us", "default", "mxfp8_over_bf16",
           "default_over_bf16", "bf16_tbps", "mxfp8_tbps", "rel_err", "dequant_rel_err"]  # fmt: skip
TIMING = {"warmup_ms": 10, "rep_ms": 50}


def measure(name: str, n: int, k: int, rows_list: list[int]) -> list[dict[str, Any]]:
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator, device="cuda") / k**0.5
    values, row_major = mxfp8.quantize(weight)
    scales = mxfp8.block_major(row_major)
    dense = mxfp8.dequantize(values, row_major, torch.bfloat16)
    fp8_bytes = values.numel() + scales.numel()
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, generator=generator, device="cuda").to(torch.bfloat16)
        plan = mxfp8_kernels.plan_launch(rows, n, k, None, x.device)
        paths = {
            "bf16": lambda: F.linear(x, dense),  # noqa: B023
            "mxfp8": lambda: mxfp8_kernels.mxfp8_linear(x, values, scales),  # noqa: B023
            # mxfp8.linear's path past DENSE_KERNEL_MAX_ROWS rows, at every size
            "dequant": lambda: F.linear(x, mxfp8_kernels.dequantize_matrix(values, scales, x.dtype)),  # noqa: B023
        }
        times = {path: cuda_time_us(graphed(call), **TIMING) for path, call in paths.items()}
        default = "dequant" if rows > mxfp8.DENSE_KERNEL_MAX_ROWS else "mxfp8"
        reference = x.float() @ dense.float().T
        errors = {path: float((paths[path]().float() - reference).norm() / reference.norm()) for path in paths}
        row = {"linear": name, "rows": rows, "split": plan.split, **{f"{key}_us": us for key, us in times.items()},
               "default": default, "mxfp8_over_bf16": times["bf16"] / times["mxfp8"],
               "default_over_bf16": times["bf16"] / times[default],
               "bf16_tbps": dense.numel() * 2 / times["bf16"] / 1e6,
               "mxfp8_tbps": fp8_bytes / times["mxfp8"] / 1e6, "rel_err": errors["mxfp8"],
               "dequant_rel_err": errors["dequant"]}  # fmt: skip
        logger.info("%s", row)
        out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for mxfp8_linears.json (default bench/results)")
    parser.add_argument("--rows", type=int_list, default=[1, 4, 16], help="rows a step (decode tokens)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = [row for name, (n, k) in LINEARS.items() for row in measure(name, n, k, args.rows)]
    write_results("mxfp8_linears", rows, {"copy_ceiling_tbps": COPY_CEILING_TBPS}, args.out)
    sys.stdout.write(markdown_table(rows, COLUMNS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
