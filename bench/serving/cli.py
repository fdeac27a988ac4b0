"""Agentic serving benchmark: closed-loop gRPC clients against the real engine server, six engine configs.

The engine is built in this process around one random-weight model (M3 attention dims, ``--layers`` layers,
dense MLPs unless ``--moe``: ``bench.engine_step.build_model``; ``--model tiny`` takes the embedded tiny checkpoint
for CPU runs) and served by the real gRPC server (``AsyncEngine`` + ``GrpcServer``) on a free loopback port; the
clients run in a spawned process of their own.  The configs differ only in their ``EngineConfig``, and ``f`` in
the format of the same model's weights:

* ``a``: the optimized engine (``attention="msa"``: Triton MSA kernels, FlashInfer; on cpu ``--msa-attention``
  defaults to ``auto``, the reference backend, since the kernels only run interpreted there);
* ``b``: the same engine with every layer dense (``attention="dense"``);
* ``c``: the naive MSA path (``attention="naive"``: reference gather + query-major, plain PyTorch);
* ``d``: ``a`` with CPU KV offload: a pinned host pool and ``--offload-device-blocks`` device blocks (default:
  the prefix + half the largest point's own blocks + one hot buffer);
* ``e``: ``a`` over fp8 caches (``--index-dtype fp8_e4m3 --kv-cache-dtype fp8_e4m3``), only when ``--configs``
  names it: FP8 rows beside bf16 ones in the same run;
* ``f``: ``a`` serving the same weights in MXFP8, only when ``--configs`` names it (``engine.mxfp8_copy``): the
  random weights quantized by ``mxfp8.quantize`` into the model the engine loads from the MiniMax-M3-MXFP8
  release, FP8 e4m3 values and E8M0 scales kept FP8 on the device and multiplied by ``mxfp8_kernels``' weight-only
  kernels on CUDA; embeddings, the LM head, norms and routers stay bf16, as in the release.  Built with ``f``'s
  engine and freed with it.  The m3dims MLPs are dense unless ``--moe`` (16 experts, top-4, on the MSA layers; M3
  itself has 128 experts, top-8, which hold most of the weights MXFP8 halves); the tiny model's are MoE but the first.
  ``extra["weights"]`` records each config's served parameter bytes by dtype and its number of MXFP8 parameters.

Workload (agentic shape): one shared prefix (``--prefix-tokens``), a unique suffix per request
(``--suffix-tokens``), ``--output-tokens`` greedy tokens with ``ignore_eos``.  Per config: an untimed warm-up
request (kernel compilation), a cold request (prefix not cached: its TTFT), then per concurrency C a closed
loop: C clients each send a request and the next when it finishes, ``max(C, --requests-per-point)`` in all.
Per point: output tok/s, TTFT and ITL p50/p90/p99 (client clock, streamed chunks), prefix hit rate (cached /
prompt tokens), preemptions, and for ``d`` the offload counters over the point (hot-buffer hit rate, bytes
moved, H2D GB/s of timed copies, stall).  A warm request only spills when its own blocks outnumber the hot
buffer it must lease (``engine.offload.tiered_manager``; ``extra["offload"]`` says whether they do): with
2K suffixes they do not, so ``d``'s device pressure shows as preemptions.  ``--long-context`` adds one
request with a very long prompt per ``--long-configs`` config: prefill time, decode tok/s with CUDA graphs for
the first half of its tokens, then eagerly (the offload's copies are timed only in eager steps), offload
counters.  ``extra`` holds the ratios a/c, a/b, d/a, e/a, e/b, f/a per concurrency (and long d/a, f/a), the
targets, and greedy agreement with a.

Budget: ``--budget-s`` wall seconds from the start.  Each config (a long run counts half, ``--weights`` changes a
config's share: the naive ``c`` needs several) gets its share of what is left; a point whose predicted time does
not fit its config's share is recorded as ``{"skipped": "budget"}``, one that overruns is cancelled and recorded
the same way.  ``serving.json`` is
rewritten after every point; a config that fails records ``"error"`` in its rows and the others still run.
``serving.svg`` plots the warm points (matplotlib is not in the environment).

    python -m bench.serving [--out DIR] [--budget-s 600] [--configs a,b,c,d] [--concurrency 1,2,4,8,16,32,64]
    python -m bench.serving --budget-s 230 --configs a,b,d,c --concurrency 1,4,16,64 --output-tokens 128 \
        --requests-per-point 2 --long-context 262144 --long-output-tokens 128      # ~4 minutes on the H200
    python -m bench.serving --name serving_af_mxfp8 --budget-s 540 --configs a,f --concurrency 1,2,4,8,16,32,64 \
        --output-tokens 512 --requests-per-point 2 --long-context 0      # MXFP8 beside bf16 (H200: not run yet)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path

from bench.common import RESULTS_DIR
from bench.serving.engine import load_model
from bench.serving.report import RATIOS, agreement, ratios, svg_plot, tables, target_report
from bench.serving.runner import run_units
from bench.serving.state import CONFIGS, DEFAULT_CONFIGS, FINAL_S, Bench
from bench.serving.workload import Workload

logger = logging.getLogger("bench.serving")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _config_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    return names


def _weights(text: str) -> dict[str, float]:
    weights = {}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        name, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT items, got {item!r}") from None
        if name not in CONFIGS or weight <= 0:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(CONFIGS)} and a weight > 0, got {item!r}")
        weights[name] = weight
    return weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="folder for serving.json / serving.svg (bench/results)")
    p.add_argument("--name", default="serving", help="results file stem: <name>.json and <name>.svg")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--model",
        choices=("m3dims", "tiny"),
        default="m3dims",
        help="m3dims: random bf16 weights at M3 attention dims; tiny: the embedded tiny checkpoint",
    )
    p.add_argument("--layers", type=int, default=8, help="m3dims layers (one dense-attention layer, then MSA)")
    p.add_argument("--moe", action="store_true", help="m3dims: MoE MLPs (16 experts, top-4) on the MSA layers")
    p.add_argument("--configs", type=_config_list, default=list(DEFAULT_CONFIGS),
                   help="of a,b,c,d,e,f (e: a over fp8 caches; f: a with MXFP8 weights), run in this order "
                        "(default a,b,c,d)")  # fmt: skip
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--prefix-tokens", type=int, default=60_000)
    p.add_argument("--suffix-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--warmup-tokens", type=int, default=2048, help="prompt of the untimed first request per config")
    p.add_argument("--requests-per-point", type=int, default=4, help="a point runs max(concurrency, this) requests")
    p.add_argument("--long-context", type=int, default=524_288, help="prompt tokens of the long run (0: none)")
    p.add_argument("--long-output-tokens", type=int, default=256)
    p.add_argument("--long-configs", type=_config_list, default=["d", "a"])
    p.add_argument(
        "--shared-page-scan",
        action="store_true",
        help="the MSA configs' decode indexer scans pages the requests share once per group of them",
    )
    p.add_argument(
        "--engine-stream",
        choices=("request", "shared"),
        default="request",
        help="the clients' gRPC: a Generate stream per request (the gateway's today), or one GenerateStream each "
        "client process shares (the engine batches a wakeup's responses into one message)",
    )
    p.add_argument(
        "--msa-attention",
        default=None,
        help="attention of configs a and d (default: msa on cuda, auto = the reference backend on cpu)",
    )
    p.add_argument(
        "--offload-device-blocks",
        type=int,
        default=0,
        help="device KV blocks of config d (0: the prefix + half the largest point + a hot buffer)",
    )
    p.add_argument("--offload-gb", type=float, default=0.0, help="pinned host GiB of offload (0: what the run needs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=600.0, help="wall seconds for everything, writing included")
    p.add_argument("--weights", type=_weights, default={},
                   help="budget shares of configs, e.g. c=3 (default 1 each; a long run counts 0.5)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.msa_attention is None:
        args.msa_attention = "msa" if args.device == "cuda" else "auto"
    return args


def run(argv: list[str] | None = None) -> Bench:
    """Run the benchmark; returns the rows, the extra fields and every request's tokens (by config and key)."""
    started = time.monotonic()  # the budget counts torch's import and the model's creation
    import torch

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.serving --device cuda: torch sees no CUDA device (use --device cpu for a CPU run)")
    device = torch.device(args.device)
    longest = max(args.prefix_tokens + args.suffix_tokens + args.output_tokens, args.long_context +
                  args.long_output_tokens) + 256  # fmt: skip
    model, m3, dtype, model_name = load_model(args, device, longest)
    workload = Workload(args.prefix_tokens, args.suffix_tokens, args.output_tokens,
                        min(m3.text.vocab_size, m3.image_token_id, m3.video_token_id), args.seed)  # fmt: skip
    bench = Bench(args, model, m3, device, dtype, workload, started + args.budget_s - FINAL_S)
    bench.extra.update({
        "model": model_name,
        "workload": dataclasses.asdict(workload) | {"concurrency": args.concurrency,
                                                    "requests_per_point": args.requests_per_point},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engines": {},
        "weights": {},
    })  # fmt: skip
    _note_offload(bench)
    if args.device == "cpu" and args.msa_attention != "msa":
        logger.warning("on cpu, configs a and d use attention=%s (the Triton kernels run only interpreted there)",
                       args.msa_attention)  # fmt: skip
    asyncio.run(run_units(bench))
    bench.extra["ratios"] = {f"{n}_over_{d}": ratios(bench.rows, n, d) for n, d in RATIOS}
    long = {r["config"]: r.get("decode_tok_s") for r in bench.rows if r.get("phase") == "long"}
    for name in ("d", "f"):
        if long.get(name) and long.get("a"):
            bench.extra["ratios"][f"long_decode_{name}_over_a"] = long[name] / long["a"]
    bench.extra["targets"] = target_report(bench.rows, workload, args.concurrency)
    # Same prompts, greedy: c and d should give a's tokens up to bf16 near ties (b attends every token: it differs);
    # e's fp8 caches and f's MXFP8 weights move them further (tests/engine/model/test_fp8_cache.py says by how much
    # for e; f's weights differ from a's by their rounding to e4m3).
    bench.extra["greedy_agreement"] = {
        f"{name}_vs_a": agreement(bench.tokens.get("a", {}), tokens) for name, tokens in bench.tokens.items()
        if name in ("c", "d", "e", "f")
    }  # fmt: skip
    bench.extra["plot"] = _write_plot(bench)
    bench.save()
    return bench


def _note_offload(bench: Bench) -> None:
    """Why the warm points of the offload config may move nothing: a request only spills when its own blocks
    outnumber the hot buffer it must lease (engine.offload.tiered_manager)."""
    own, hot = bench.own_blocks(bench.workload.output_tokens), bench.hot_blocks()
    bench.extra["offload"] = {"device_blocks": bench.offload_device_blocks(), "own_blocks_per_request": own,
                              "hot_buffer_blocks": hot, "warm_requests_can_spill": own - 1 > hot}  # fmt: skip


def _write_plot(bench: Bench) -> str:
    path = (bench.args.out or RESULTS_DIR) / f"{bench.args.name}.svg"  # by hand: matplotlib is not in the environment
    w = bench.workload
    title = (f"{bench.extra['model']}: {w.prefix_tokens} shared + {w.suffix_tokens} own prompt tokens, "
             f"{w.output_tokens} out")  # fmt: skip
    path.write_text(svg_plot(bench.rows, title))
    return path.name


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bench = run(argv)
    sys.stdout.write(tables(bench.rows, bench.extra, bench.args.concurrency))
    return 1 if any("error" in r for r in bench.rows) else 0
