"""Host-side input preparation of a decode step, alone: what ``bench.engine_step`` reports as ``prepare_ms``.

The real scheduler, KV cache manager, ``ModelRunner`` (decode-graph path: padded persistent buffers,
placeholders filled on the device) and ``GpuAttentionBackend`` planning (MSA decode plan, FlashInfer
``plan()`` where FlashInfer runs) over M3 attention dims (Hkv 4, D 128, index dim 128, blocks of 128,
top-16), with the model stubbed out: the "graph replay" returns a fixed logits buffer and runs
nothing, so the step loop measures only the host.  ``concurrency`` requests with ``--context``-token
prompts are taken to decode (their prefill is booked, not computed), then ``--steps`` async-scheduled
decode steps are timed (medians): ``prepare`` (runner launch up to the forward launch), ``schedule``,
``update`` and the whole ``EngineCore.step()``.

Runs on CPU (the GPU backend's planning under ``TRITON_INTERPRET=1``; FlashInfer absent, so its
``plan()`` is not in the CPU figures) or CUDA (FlashInfer included, no GPU work to hide behind).

    python -m bench.engine_prepare [--device cpu|cuda] [--out DIR] [--context 1024] [--steps 200]
"""

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, write_results

logger = logging.getLogger("bench.engine_prepare")

CONCURRENCIES = (1, 8, 64)
WARMUP_STEPS = 20
BLOCK = 128
NUM_KV_HEADS, HEAD_DIM, INDEX_HEAD_DIM, NUM_Q_HEADS = 4, 128, 128, 64
TOPK_BLOCKS, LOCAL_BLOCKS = 16, 1
VOCAB = 1024  # the stub's logits: sampling is device work, not preparation


class _StubModel:
    """Stands in for the model: nothing here is timed (the decode-graph path never calls it)."""

    def forward(self, input_ids, positions, attn_backend, mm_positions, mm_embeds):
        raise RuntimeError("the prepare benchmark runs only decode steps through the stub graphs")

    def compute_logits(self, hidden):
        raise RuntimeError("the prepare benchmark runs only decode steps through the stub graphs")


def _build_core(concurrency: int, max_len: int, device: torch.device) -> Any:
    from m3stack.engine.attention.gpu import GpuAttentionBackend
    from m3stack.engine.kv_cache.manager import KVCacheManager
    from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
    from m3stack.engine.runtime.cuda_graphs import DecodeGraphs
    from m3stack.engine.runtime.encoder_cache import EncoderCache
    from m3stack.engine.runtime.engine_core import EngineCore
    from m3stack.engine.runtime.model_info import ModelInfo
    from m3stack.engine.runtime.runner import ModelRunner
    from m3stack.engine.runtime.scheduler import Scheduler, SchedulerConfig

    class PrepareOnlyGraphs(DecodeGraphs):
        """Every batch size counts as captured; a replay returns a fixed buffer and launches nothing."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.graphs = dict.fromkeys(self.sizes)  # type: ignore[arg-type]
            self._logits = torch.zeros((self.buffers.max_batch, VOCAB), dtype=torch.float32, device=device)

        def replay(self, size: int, num_requests: int) -> torch.Tensor:
            return self._logits[:num_requests]

    num_blocks = 2 * concurrency * -(-max_len // BLOCK) + 1
    # One dense layer and one MSA layer: planning reads only the cache shapes, not the layer count.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                       index_head_dim=INDEX_HEAD_DIM, sparse_layers=(False, True), dtype=torch.bfloat16)  # fmt: skip
    kv_caches = allocate_kv_cache(spec, num_blocks, device)
    backend = GpuAttentionBackend(kv_caches, topk_blocks=TOPK_BLOCKS, local_blocks=LOCAL_BLOCKS,
                                  num_q_heads=NUM_Q_HEADS)  # fmt: skip
    encoder_cache = EncoderCache(4096)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=max_len, max_num_seqs=concurrency, max_num_batched_tokens=8192),
        KVCacheManager(num_blocks, BLOCK),
        encoder_cache,
    )
    graphs = PrepareOnlyGraphs(_StubModel(), backend, device, block_size=BLOCK, max_batch=concurrency,
                               max_model_len=max_len)  # fmt: skip
    runner = ModelRunner(_StubModel(), backend, encoder_cache, block_size=BLOCK, vocab_size=VOCAB, device=device,
                         dtype=torch.bfloat16, decode_graphs=graphs)  # fmt: skip
    info = ModelInfo(model_path="stub", served_model_name="stub", model_type="minimax_m3_vl", vocab_size=VOCAB,
                     max_model_len=max_len, eos_token_ids=(), bos_token_id=None, block_size=BLOCK, image_token_id=0,
                     video_token_id=0, patch_dim=1, spatial_merge_size=2, supports_vision=False, dtype="bfloat16",
                     device=device.type, num_kv_blocks=num_blocks - 1)  # fmt: skip
    return EngineCore(info, scheduler, runner, async_scheduling=True)


def _book_prefill(core: Any) -> None:
    """Take every request to decode without running the model: book each prefill as computed."""
    from m3stack.engine.runtime.request import SampledToken

    scheduler = core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update(out, {s.request.request_id: SampledToken(1) for s in out.requests if s.samples})


def measure(device: torch.device, concurrency: int, context: int, steps: int) -> dict[str, Any]:
    from m3stack.engine.runtime.request import Request, SamplingParams

    max_len = context + WARMUP_STEPS + steps + 16
    core = _build_core(concurrency, max_len, device)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_STEPS + steps + 8, ignore_eos=True)
    for index in range(concurrency):
        prompt = [(index * 7919 + t) % (VOCAB - 1) + 1 for t in range(context)]
        core.scheduler.add_request(Request(f"p{index}", prompt, sampling, max_tokens=WARMUP_STEPS + steps + 8))
    _book_prefill(core)
    for _ in range(WARMUP_STEPS):
        core.step()
    runner = core.runner
    runner.timing = True
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        report = core.step()
        wall = time.perf_counter() - start
        if report.num_requests != concurrency or not report.is_pure_decode:
            raise RuntimeError(f"step ran {report.num_requests} requests, pure decode {report.is_pure_decode}")
        samples.append((wall, report.schedule_s, runner.last_timing.prepare_s, report.update_s))
    if runner.num_eager_steps:
        raise RuntimeError(f"{runner.num_eager_steps} steps ran eagerly: the stub graphs were bypassed")
    wall, schedule, prepare, update = (statistics.median(column) for column in zip(*samples, strict=True))
    return {
        "device": device.type,
        "concurrency": concurrency,
        "prepare_ms": prepare * 1e3,
        "prepare_p90_ms": statistics.quantiles([s[2] for s in samples], n=10)[-1] * 1e3,
        "schedule_ms": schedule * 1e3,
        "update_ms": update * 1e3,
        "step_ms": wall * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="folder for engine_prepare.json (default bench/results)")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per point")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the engine's host side)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the GPU backend plans over CPU tensors (no kernel runs here)
    elif not torch.cuda.is_available():
        logger.error("--device cuda needs a CUDA GPU")
        return 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    with torch.inference_mode():
        for concurrency in CONCURRENCIES:
            row = measure(device, concurrency, args.context, args.steps)
            logger.info("%s", row)
            rows.append(row)
    model = "stubbed forward; M3 attention dims (Hkv 4, D 128, index dim 128, block 128, top-16)"
    extra = {"context": args.context, "steps": args.steps, "threads": args.threads, "model": model}
    write_results("engine_prepare", rows, extra, out_dir=args.out)
    columns = ["device", "concurrency", "prepare_ms", "prepare_p90_ms", "schedule_ms", "update_ms", "step_ms"]
    sys.stdout.write(markdown_table(rows, columns) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
