"""The MXFP8 kernels' launch configurations at decode sizes on one GPU: the CUDA-core GEMV (one row a program;
tile, warps) against the MMA decode tiles and against bf16 (cuBLAS, torch's grouped GEMM) on the same dequantized
weights, in the same run.  What ``mxfp8_kernels.GEMV_TILES`` and the row limits of ``choose_tiles`` come from.

* Grouped: M3's experts (128 of 6144 x 6144 gate|up, 6144 x 3072 down), each token routed to 8 distinct experts,
  at 1-64 tokens a step (``--experts``, ``--top-k``: other counts of the same experts).
* Dense: M3's decode linears (``bench.mxfp8_linears.LINEARS``) at 1-64 rows, beside each MMA tile class.

Each case is CUDA-graphed (decode runs graphed), CUDA-event medians with the L2 flushed (``triton.testing.do_bench``),
and each output checked against the bf16 one (``*_err``, relative).  ``best`` names the fastest configuration.

    python -m bench.mxfp8_gemv [--out DIR] [--budget-s S]
"""

import argparse
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import cuda_time_us, graphed, int_list, markdown_table, write_results
from bench.mxfp8_linears import LINEARS
from m3stack.engine.model import mxfp8, mxfp8_kernels
from m3stack.engine.model.moe import grouped_mm
from m3stack.engine.model.mxfp8_kernels import Tiles

logger = logging.getLogger("bench.mxfp8_gemv")

TIMING = {"warmup_ms": 5, "rep_ms": 25}
HIDDEN, INTER = 6144, 3072
EXPERTS, TOP_K = 128, 8  # M3's; --experts and --top-k for other MoE shapes (the serving benchmark's 16 and 4)
GROUPED_TOKENS = [1, 2, 4, 8, 16, 32, 64]
DENSE_ROWS = [1, 2, 4, 16, 64]
GEMVS = [
    Tiles(1, 16, 512, 4, 1),
    Tiles(1, 16, 512, 2, 1),
    Tiles(1, 16, 256, 4, 1),
    Tiles(1, 8, 512, 4, 1),
    Tiles(1, 32, 512, 4, 1),
    Tiles(1, 16, 1024, 4, 1),
]
# The GEMV is timed up to here (each row's program widens the weights again): tokens (experts), rows (dense)
GEMV_UP_TO_TOKENS, GEMV_UP_TO_ROWS = 16, 4
# MMA tiles beside the GEMV: the plan's for each case and swap_ab variants (out.T = W x.T, the weights on the MMA's
# M side; the dense 17-64-row plan is one), candidates that compile for sm_90 (Triton 3.6) to warpgroup MMAs without
# spills (bench.sm90_compile).  --tiles times others.
SWAP_CANDIDATES = [Tiles(16, 64, 128, 4, 3, swap_ab=True)]
GROUPED_MMAS = [mxfp8_kernels.DECODE_TILES, replace(mxfp8_kernels.DECODE_TILES, swap_ab=True), *SWAP_CANDIDATES]
DENSE_MMAS = [mxfp8_kernels.DECODE_TILES, mxfp8_kernels.MEDIUM_TILES,
              mxfp8_kernels.DENSE_MEDIUM_TILES, replace(mxfp8_kernels.DECODE_TILES, swap_ab=True),
              replace(mxfp8_kernels.MEDIUM_TILES, swap_ab=True), *SWAP_CANDIDATES,
              Tiles(64, 64, 64, 4, 3, swap_ab=True)]  # fmt: skip
# --splits, from 16 rows on: the MMA tiles at fixed K splits too (each split writes and reads back rows x N float32
# partials; no split brought 64 rows within 1.6x of cuBLAS: bench/results/mxfp8_gemv_dense_splits.json)
DENSE_SPLITS = [replace(tiles, split_k=split) for split in (1, 2, 3, 4)
                for tiles in (mxfp8_kernels.DECODE_TILES, mxfp8_kernels.DENSE_MEDIUM_TILES)]  # fmt: skip
COLUMNS = ["case", "bf16_us", "default", "default_us", "best", "best_us", "bf16_over_default", "bf16_over_best"]


def short(tiles: Tiles) -> str:
    """A configuration's name in the tables; ``parse_tiles`` reads it back."""
    kind = "gemv" if tiles.gemv else f"mma{tiles.widen}" + (" swap_ab" if tiles.swap_ab else "")
    split = f" split{tiles.split_k}" if tiles.split_k else ""
    return f"{kind} {tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}{split}"


_SHORT_NAME = re.compile(
    r"(?:gemv|mma(?P<widen>\d))(?P<swap> swap_ab)? (?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+) w(?P<warps>\d+) s(?P<stages>\d+)"
    r"(?: split(?P<split>\d+))?"
)


def parse_tiles(name: str) -> Tiles:
    """The configuration ``short`` names ``name`` (a ``best`` column's value fed back through ``--tiles``)."""
    found = _SHORT_NAME.fullmatch(name.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{name!r} is not a configuration name like 'mma0 swap_ab 32x128x128 w4 s4'")
    sizes = (int(found[key]) for key in ("m", "n", "k", "warps", "stages"))
    try:
        tiles = Tiles(
            *sizes, split_k=int(found["split"] or 0), widen=int(found["widen"] or 0), swap_ab=bool(found["swap"])
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{name!r}: {error}") from error
    if tiles.gemv != name.strip().startswith("gemv"):
        raise argparse.ArgumentTypeError(f"{name!r}: the GEMV is the 1-row configuration and only it")
    return tiles


def tiles_list(text: str) -> list[Tiles]:
    """argparse type: comma-separated configuration names."""
    return [parse_tiles(name) for name in text.split(",") if name.strip()]


def random_mxfp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP8 weights: values, row-major scales, and the bf16 dequantization."""
    values, scales = mxfp8.quantize(torch.randn(shape, device="cuda") / shape[-1] ** 0.5)
    return values, scales, mxfp8.dequantize(values, scales, torch.bfloat16)


def stacked(count: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` stacked random MXFP8 matrices (one at a time: float32 temporaries), block-major scales."""
    parts = [random_mxfp8(n, k) for _ in range(count)]
    values, scales, dense = (torch.stack(column) for column in zip(*parts, strict=True))
    return values, mxfp8.block_major(scales), dense


def case_row(
    case: str,
    bf16: Callable[[], torch.Tensor],
    ours: Callable[[Tiles], torch.Tensor],
    default: Tiles,
    configurations: list[Tiles],
    budget_end: float,
) -> dict[str, Any]:
    """One case: bf16, the default plan and the other ``configurations``, timed and checked."""
    reference = bf16().float()
    row: dict[str, Any] = {"case": case, "bf16_us": cuda_time_us(graphed(bf16), **TIMING), "default": short(default)}
    for tiles in dict.fromkeys([default, *configurations]):
        if time.monotonic() > budget_end:
            logger.warning("%s: configurations left out by --budget-s", case)
            break
        out = ours(tiles).float()
        row[f"{short(tiles)}_us"] = cuda_time_us(graphed(lambda: ours(tiles)), **TIMING)  # noqa: B023
        row[f"{short(tiles)}_err"] = float((out - reference).norm() / reference.norm())
    times = {key[:-3]: us for key, us in row.items() if key.endswith("_us") and key != "bf16_us"}
    if times:  # none where the budget ran out before the case's first configuration
        row["default_us"] = times.get(short(default))
        row["best"] = min(times, key=times.__getitem__)
        row["best_us"] = times[row["best"]]
        row["bf16_over_default"] = row["bf16_us"] / row["default_us"] if row["default_us"] else None
        row["bf16_over_best"] = row["bf16_us"] / row["best_us"]
    logger.info("%s", row)
    return row


def grouped_rows(
    experts: int, top_k: int, token_counts: list[int], configurations: list[Tiles] | None, budget_end: float
) -> list[dict[str, Any]]:
    rows = []
    mats = {"gate|up": stacked(experts, 2 * INTER, HIDDEN), "down": stacked(experts, HIDDEN, INTER)}
    cases = [(tokens, name) for tokens in token_counts for name in mats]
    for tokens, name in tqdm(cases, desc="grouped"):
        values, scales, dense = mats[name]
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        chosen = torch.rand(tokens, experts, generator=generator, device="cuda").topk(top_k).indices
        ids = chosen.flatten().sort().values
        ends = torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32)
        x = torch.randn(ids.numel(), values.shape[2], generator=generator, device="cuda").to(torch.bfloat16)
        rows.append(
            case_row(
                f"{experts} experts top-{top_k} {name} {tokens} tokens",
                lambda: grouped_mm(x, dense.transpose(1, 2), ends),  # noqa: B023
                lambda tiles: mxfp8_kernels.mxfp8_grouped_mm(x, values, scales, ends, tiles),  # noqa: B023
                mxfp8_kernels.choose_tiles(x.shape[0], experts),
                configurations or GROUPED_MMAS + (GEMVS if tokens <= GEMV_UP_TO_TOKENS else []),
                budget_end,
            )
        )
    return rows


def dense_rows(
    counts: list[int], splits: bool, configurations: list[Tiles] | None, budget_end: float
) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in tqdm(LINEARS.items(), desc="dense"):
        values, row_major, dense = random_mxfp8(n, k)
        scales = mxfp8.block_major(row_major)
        for count in counts:
            x = torch.randn(count, k, device="cuda").to(torch.bfloat16)
            rows.append(
                case_row(
                    f"{name} {count} rows",
                    lambda: torch.nn.functional.linear(x, dense),  # noqa: B023
                    lambda tiles: mxfp8_kernels.mxfp8_linear(x, values, scales, tiles),  # noqa: B023
                    mxfp8_kernels.choose_tiles(count, 1),
                    configurations
                    or DENSE_MMAS
                    + (GEMVS if count <= GEMV_UP_TO_ROWS else [])
                    + (DENSE_SPLITS if splits and count >= 16 else []),
                    budget_end,
                )
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for mxfp8_gemv.json (default bench/results)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="time no new configuration past this")
    parser.add_argument("--parts", default="experts,dense", help="which cases: experts, dense or both")
    parser.add_argument("--experts", type=int, default=EXPERTS, help="experts of the grouped cases")
    parser.add_argument("--top-k", type=int, default=TOP_K, help="experts a token routes to")
    parser.add_argument("--tokens", type=int_list, default=GROUPED_TOKENS, help="tokens of the grouped cases")
    parser.add_argument("--splits", action="store_true", help="also the dense MMA tiles at fixed K splits")
    parser.add_argument("--dense-rows", type=int_list, default=DENSE_ROWS, help="rows of the dense cases")
    parser.add_argument(
        "--tiles",
        type=tiles_list,
        default=None,
        help="time these configurations (names as the tables print them) "
        "beside the default plan instead of the built-in candidates; e.g. 'mma0 swap_ab 32x128x128 w4 s4,...'",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    budget_end = time.monotonic() + args.budget_s
    parts = set(args.parts.split(","))
    rows = grouped_rows(args.experts, args.top_k, args.tokens, args.tiles, budget_end) if "experts" in parts else []
    torch.cuda.empty_cache()
    rows += dense_rows(args.dense_rows, args.splits, args.tiles, budget_end) if "dense" in parts else []
    write_results("mxfp8_gemv", rows, {"configurations": [short(tiles) for tiles in GEMVS]}, args.out)
    sys.stdout.write(markdown_table(rows, COLUMNS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
