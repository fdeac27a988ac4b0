"""Tensor parallelism on one host: TP=1 against TP=2 (NCCL), decode and prefill throughput, same run.

The model has M3's attention dims (64 query heads, 4 KV heads, head dim 128, MSA blocks of 128, top-16) and
few layers (default 4: one dense-attention layer, then MSA layers with 16-expert top-4 MoE MLPs), random bf16
weights written once as a sharded safetensors checkpoint, so TP=2 runs the real per-rank slice loading.  Each
engine is the real one (``build_engine_core``; TP=2 spawns the second rank), decode steps replaying CUDA graphs
on every rank (``--eager`` for none; each decode row counts the steps that replayed), with a fixed 20 GiB KV cache
per rank.

* prefill: ``--prefill-requests`` prompts of ``--prefill-len`` tokens, one output token each; prompt tokens/s.
* decode: ``concurrency`` requests with ``--context``-token prompts, prefilled, then ``--decode-steps`` steps
  timed; output tokens/s.
* agreement: greedy tokens of TP=2 equal to TP=1's (first 32 tokens of one prompt), reported, not asserted:
  bf16 partial sums reduced across ranks round differently from one GEMM (the GPU test asserts equality in
  float32).

Keeps NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 in every process.
Time-boxed by ``--budget-s`` (points left out once it is spent); always writes ``multi_gpu.json``; prints a
markdown table last::

    python -m bench.multi_gpu [--out DIR] [--layers 4] [--budget-s 200] [--expert-parallel] [--eager]
"""

import argparse
import gc
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from m3stack.engine.distributed.config import MULTICAST_OFF_ENV

os.environ.update(MULTICAST_OFF_ENV)  # before torch initialises CUDA or NCCL

import torch
from safetensors.torch import save_file

from bench.common import markdown_table, write_results
from bench.engine_step import VOCAB, model_config
from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import stop_parallel_engine
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.weights import checkpoint_tensors
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

logger = logging.getLogger("bench.multi_gpu")

CONCURRENCIES = (1, 8, 64)
SHARD_BYTES = 4 * 2**30
AGREEMENT_TOKENS = 32
KV_CACHE_GB = 20.0


def write_checkpoint(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Random bf16 weights for ``config`` (HF layout, sharded safetensors + index), made on the GPU; reused when
    the folder already holds this config."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()) == config:
        return folder
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for spec in checkpoint_tensors(parse_config(config)):
        if len(spec.shape) == 1:  # norms (stored as weight - 1), biases, the router's correction bias
            value = 0.05 * torch.randn(spec.shape, generator=generator, device="cuda")
        else:
            fan_in = math.prod(spec.shape[1:])
            value = torch.randn(spec.shape, generator=generator, device="cuda") / fan_in**0.5
        value = value.to(torch.bfloat16).cpu()
        if size + value.numel() * 2 > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][spec.name] = value
        size += value.numel() * 2
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_path.write_text(json.dumps(config))
    return folder


def _requests(core: EngineCore, tag: str, count: int, length: int, new_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for index in range(count):
        prompt = [rng.randrange(VOCAB - 200) for _ in range(length)]
        core.add_request(build_request(core.info, f"{tag}-{index}", prompt, sampling))


def _drain(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for output in core.step().outputs:
            if output.error is not None:
                raise output.error
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def measure_prefill(core: EngineCore, requests: int, length: int) -> dict[str, Any]:
    _requests(core, "warm", 1, length, 1, 0)
    _drain(core)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _requests(core, "prefill", requests, length, 1, 1)
    _drain(core)
    seconds = time.perf_counter() - start
    return {"phase": "prefill", "concurrency": requests, "tokens": requests * length, "seconds": seconds,
            "tokens_per_s": requests * length / seconds}  # fmt: skip


def measure_decode(core: EngineCore, concurrency: int, context: int, steps: int) -> dict[str, Any]:
    _requests(core, f"decode{concurrency}", concurrency, context, steps + 4, concurrency)
    while core.scheduler.waiting or any(r.num_output_tokens < 2 for r in core.scheduler.running):
        core.step()
    torch.cuda.synchronize()
    graph_steps = core.runner.num_graph_steps
    start = time.perf_counter()
    produced = 0
    for _ in range(steps):
        report = core.step()
        produced += sum(len(o.new_token_ids) for o in report.outputs)
    seconds = time.perf_counter() - start
    for request_id in list(core.scheduler.requests):
        core.abort_request(request_id, "benchmark done")
    _drain(core)
    return {"phase": "decode", "concurrency": concurrency, "tokens": produced, "seconds": seconds,
            "tokens_per_s": produced / seconds, "ms_per_step": seconds / steps * 1e3,
            "graph_steps": core.runner.num_graph_steps - graph_steps}  # fmt: skip


def run_engine(checkpoint: Path, tp: int, args: argparse.Namespace, deadline: float) -> tuple[list[dict], list[int]]:
    parallel = ParallelConfig(tensor_parallel=tp, expert_parallel=args.expert_parallel and tp > 1)
    max_len = max(args.context, args.prefill_len) + args.decode_steps + 64
    config = EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", max_num_seqs=max(CONCURRENCIES),
                          max_num_batched_tokens=8192, max_model_len=max_len, kv_cache_gb=KV_CACHE_GB,
                          cuda_graphs=not args.eager, parallel=parallel)  # fmt: skip
    core = build_engine_core(config)
    rows: list[dict] = []
    try:
        _requests(core, "agree", 1, 1000, AGREEMENT_TOKENS, 99)
        tokens = _drain(core)["agree-0"]
        points = [("prefill", args.prefill_requests)] + [("decode", c) for c in CONCURRENCIES]
        for phase, concurrency in points:
            if time.monotonic() > deadline:
                logger.warning("budget spent: TP=%d %s at %d left out", tp, phase, concurrency)
                continue
            if phase == "prefill":
                row = measure_prefill(core, concurrency, args.prefill_len)
            else:
                row = measure_decode(core, concurrency, args.context, args.decode_steps)
            row = {"tp": tp, **row}
            logger.info("%s", row)
            rows.append(row)
    finally:
        if tp > 1:
            stop_parallel_engine(core)
        del core
        gc.collect()
        torch.cuda.empty_cache()
    return rows, tokens


def _speedups(rows: list[dict]) -> None:
    """TP=2 over TP=1 throughput for each (phase, concurrency) measured at both."""
    base = {(r["phase"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["tp"] == 1}
    for row in rows:
        key = (row["phase"], row["concurrency"])
        if row["tp"] != 1 and key in base:
            row["speedup_vs_tp1"] = row["tokens_per_s"] / base[key]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for multi_gpu.json (default bench/results)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dense", action="store_true", help="dense MLPs instead of MoE on the MSA layers")
    parser.add_argument("--expert-parallel", action="store_true", help="TP=2 holds 8 whole experts per rank")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of the decode points")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--prefill-requests", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new points after this")
    parser.add_argument("--eager", action="store_true", help="no decode CUDA graphs on any rank")
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/m3stack-bench-m3dims"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    deadline = time.monotonic() + args.budget_s
    rows: list[dict] = []
    extra: dict[str, Any] = {
        "model": f"random bf16 weights, M3 attention dims, {args.layers} layers, "
        f"{'dense' if args.dense else '16-expert top-4 MoE'} MLPs",
        "moe_layout": "expert-parallel" if args.expert_parallel else "tensor-parallel experts",
        "cuda_graphs": not args.eager,
        "env": MULTICAST_OFF_ENV,
    }
    try:
        if torch.cuda.device_count() < 2:
            raise RuntimeError(f"bench.multi_gpu needs 2 GPUs, torch sees {torch.cuda.device_count()}")
        checkpoint = write_checkpoint(args.checkpoint, model_config(args.layers, not args.dense))
        tokens = {}
        for tp in (1, 2):
            tp_rows, tokens[tp] = run_engine(checkpoint, tp, args, deadline)
            rows += tp_rows
        same = sum(a == b for a, b in zip(tokens[1], tokens[2], strict=True))
        first = next((i for i, (a, b) in enumerate(zip(tokens[1], tokens[2], strict=True)) if a != b), None)
        extra["greedy_agreement"] = {"equal_tokens": same, "of": AGREEMENT_TOKENS, "first_difference": first}
        _speedups(rows)
    except Exception as exc:
        logger.exception("benchmark failed")
        extra["error"] = f"{type(exc).__name__}: {exc}"
    write_results("multi_gpu", rows, extra, out_dir=args.out)
    columns = ["tp", "phase", "concurrency", "tokens", "seconds", "tokens_per_s", "ms_per_step", "speedup_vs_tp1"]
    sys.stdout.write(json.dumps(extra.get("greedy_agreement")) + "\n" + markdown_table(rows, columns) + "\n")
    return 1 if "error" in extra else 0


if __name__ == "__main__":
    sys.exit(main())
