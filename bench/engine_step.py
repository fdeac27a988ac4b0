"""Engine decode step on the GPU: host time (scheduling, bookkeeping, input preparation) vs device time.

A random-weight model with M3's attention dims (64 query heads, 4 KV heads, head dim 128, MSA
blocks of 128, top-16) and fewer layers (default 16: one dense-attention layer, then MSA layers;
dense MLPs by default because the MoE forward synchronizes with the host once per layer, see
``--moe``).  ``concurrency`` requests with ``--context``-token prompts are prefilled, then
``--steps`` plain decode steps are timed in three modes, in the same run: ``graphs`` (decode CUDA
graphs when the model and attention backend allow capture, the ``graphs`` column says whether they
did, and async scheduling), ``eager`` (async scheduling, no graphs) and ``sync`` (no graphs, each
step finished before the next is scheduled: the host and the GPU take turns).

Per step: ``wall`` is one ``EngineCore.step()`` on the host clock (in steady state, the period of
the step loop); ``gpu`` is CUDA-event time from a step's forward launch to the end of its sampling;
``host`` = wall - gpu, the time the GPU waits for the host (scheduling, input preparation, attention
planning, sampling setup, bookkeeping, whatever async scheduling does not hide).  ``wait`` is the host
waiting for a step's tokens: with async scheduling it is where the host idles while the GPU works, so
``schedule + prepare + update`` is the host's own work per step.  Target: host < 10% of the step with
CUDA graphs.  Medians.

    python -m bench.engine_step [--out DIR] [--layers 16] [--context 1024] [--steps 100]
"""

import argparse
import gc
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, write_results
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.core import assemble_engine_core
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

logger = logging.getLogger("bench.engine_step")

CONCURRENCIES = (1, 8, 64)
WARMUP_STEPS = 10
PREFILL_STEPS_MARGIN = 64  # decode steps the earliest request may run before the last one is prefilled
VOCAB = 200064


def model_config(layers: int, moe: bool) -> dict[str, Any]:
    """``config.json`` of the benchmark model: M3 attention dims, ``layers`` layers, a small vision tower."""
    layer_types = ["full_attention"] + ["minimax_m3_sparse"] * (layers - 1)
    mlp_types = ["dense"] + ["sparse" if moe else "dense"] * (layers - 1)
    return {
        "model_type": "minimax_m3_vl",
        "image_token_index": 200025,
        "video_token_index": 200026,
        "projector_hidden_size": 512,
        "text_config": {
            "vocab_size": VOCAB,
            "hidden_size": 6144,
            "num_hidden_layers": layers,
            "layer_types": layer_types,
            "mlp_layer_types": mlp_types,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
            "max_position_embeddings": 131072,
            "dense_intermediate_size": 12288,
            "intermediate_size": 3072,
            "shared_intermediate_size": 3072,
            "num_local_experts": 16,
            "num_experts_per_tok": 4,
            "index_n_heads": 4,
            "index_head_dim": 128,
            "index_block_size": 128,
            "index_topk_blocks": 16,
            "index_local_blocks": 1,
        },
        "vision_config": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
    }


def build_model(layers: int, moe: bool, device: torch.device) -> tuple[M3ForServing, Any]:
    m3 = parse_config(model_config(layers, moe))
    model = M3ForServing(m3, torch.bfloat16, device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model.eval(), m3


def measure(core: EngineCore, concurrency: int, context: int, steps: int) -> dict[str, Any]:
    rng = random.Random(concurrency)
    # Requests prefilled first decode while the rest prefill, so each gets room for every step of the point.
    sampling = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_STEPS + steps + PREFILL_STEPS_MARGIN,
                              ignore_eos=True)  # fmt: skip
    for index in range(concurrency):
        prompt = [rng.randrange(VOCAB - 200) for _ in range(context)]
        core.add_request(build_request(core.info, f"c{concurrency}-{index}", prompt, sampling))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    for _ in range(WARMUP_STEPS):
        core.step()
    runner = core.runner
    runner.timing = True
    graph_steps_before = runner.num_graph_steps
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        report = core.step()
        wall = time.perf_counter() - start
        if report.num_requests != concurrency or not report.is_pure_decode:
            raise RuntimeError(f"step ran {report.num_requests} requests, pure decode {report.is_pure_decode}")
        samples.append((wall, runner.last_timing.gpu_s, report.schedule_s, runner.last_timing.prepare_s,
                        report.wait_s, report.update_s))  # fmt: skip
    runner.timing = False
    for request_id in list(core.scheduler.requests):
        core.abort_request(request_id, "benchmark done")
    while core.has_work:  # the step still in flight
        core.step()
    wall, gpu, schedule, prepare, wait, update = (statistics.median(column) for column in zip(*samples, strict=True))
    host = statistics.median(w - g for w, g, *_ in samples)
    return {
        "concurrency": concurrency,
        "graphs": runner.num_graph_steps - graph_steps_before == steps,
        "wall_ms": wall * 1e3,
        "gpu_ms": gpu * 1e3,
        "host_ms": host * 1e3,
        "host_fraction": host / wall,
        "schedule_ms": schedule * 1e3,
        "prepare_ms": prepare * 1e3,
        "wait_ms": wait * 1e3,
        "update_ms": update * 1e3,
        "tokens_per_s": concurrency / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for engine_step.json (default bench/results)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--moe", action="store_true", help="MoE MLPs (16 experts, top-4) on the MSA layers")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per point")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logger.error("bench.engine_step needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    model, m3 = build_model(args.layers, args.moe, device)
    max_len = args.context + WARMUP_STEPS + args.steps + PREFILL_STEPS_MARGIN + 16
    # Twice what the largest point holds: a cache sized to the block leaves no room for the scheduler's
    # headroom and preempts requests mid-measurement.
    blocks = 2 * max(CONCURRENCIES) * -(-max_len // 128)
    rows = []
    for mode, graphs, overlap in (("graphs", True, True), ("eager", False, True), ("sync", False, False)):
        config = EngineConfig(
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max(CONCURRENCIES),
            max_num_batched_tokens=8192,
            max_model_len=max_len,
            num_kv_blocks=blocks,
            cuda_graphs=graphs,
            async_scheduling=overlap,
        )
        core = assemble_engine_core(config, model, m3, model_path=f"random-m3-dims-{args.layers}-layers", device=device,
                                    dtype=torch.bfloat16)  # fmt: skip
        for concurrency in CONCURRENCIES:
            row = {"mode": mode, **measure(core, concurrency, args.context, args.steps)}
            logger.info("%s", row)
            rows.append(row)
        del core
        gc.collect()
        torch.cuda.empty_cache()
    mlp = "MoE" if args.moe else "dense"
    extra = {
        "model": f"random weights, M3 attention dims, {args.layers} layers, {mlp} MLPs, bf16",
        "context": args.context,
        "steps": args.steps,
        "target": "host_fraction < 0.10 with CUDA graphs",
    }
    write_results("engine_step", rows, extra, out_dir=args.out)
    columns = ["mode", "concurrency", "graphs", "wall_ms", "gpu_ms", "host_ms", "host_fraction", "schedule_ms",
               "prepare_ms", "wait_ms", "update_ms", "tokens_per_s"]  # fmt: skip
    sys.stdout.write(markdown_table(rows, columns) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
