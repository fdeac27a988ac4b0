"""Running the benchmark within its budget: the configs and long runs in turn, each config's warm-up, cold
request, priming and closed-loop points, and the long-context request."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.serving.client import ClientProcess, RequestResult, describe_error, progress, stream_request
from bench.serving.engine import ServedEngine, build_core, free_device_memory, served_weights
from bench.serving.report import decode_rate, offload_delta, summarize
from bench.serving.state import Bench
from bench.serving.workload import random_ids, requests_per_point
from m3stack.engine import kernel_compiles

if TYPE_CHECKING:
    from m3stack.engine.runtime.engine_core import EngineCore

logger = logging.getLogger("bench.serving")

LONG_WEIGHT = 0.5  # a long run's budget share relative to a config's serving points
COLD_OUTPUT_TOKENS = 8
TEARDOWN_S = 3.0  # kept back from each share: stopping the server, freeing the KV cache


def predict_point_s(requests: int, concurrency: int, last_concurrency: int, last_e2e_s: float) -> float:
    """Wall time of a closed-loop point: requests per client x the last point's request latency, grown with the
    batch (the naive path's decode steps grow about linearly with it, the others' less: this errs towards
    skipping a point rather than cancelling it halfway)."""
    return math.ceil(requests / concurrency) * last_e2e_s * max(1.0, concurrency / last_concurrency)


async def run_units(bench: Bench) -> None:
    """Every config, then every long run: each gets its share of the time left (``--weights``, default 1), a long run
    half a share."""
    args = bench.args
    units: list[tuple[str, float, Callable]] = [
        (name, args.weights.get(name, 1.0), run_config) for name in args.configs
    ]
    if args.long_context:
        units += [(name, LONG_WEIGHT, run_long) for name in args.long_configs]
    bench.client = ClientProcess()  # starts while the first engine is built
    try:
        for index, (name, weight, runner) in enumerate(units):
            share = max(0.0, bench.deadline - time.monotonic()) * weight / sum(w for _, w, _ in units[index:])
            await runner(bench, name, share)
    finally:
        if bench.client.alive:
            bench.client.close()


# --- one config ----------------------------------------------------------------------------------------------------


async def run_config(bench: Bench, name: str, share_s: float) -> None:
    """Cold request, then one closed-loop point per concurrency, within ``share_s`` seconds."""
    args, w = bench.args, bench.workload
    end = min(time.monotonic() + share_s - TEARDOWN_S, bench.deadline)
    base = bench.row_fields(name)
    done: set[int] = set()
    served: ServedEngine | None = None
    try:
        if end <= time.monotonic():
            raise TimeoutError
        new_tokens = max(w.output_tokens, COLD_OUTPUT_TOKENS)
        needed = bench.prefix_blocks + max(args.concurrency) * bench.own_blocks(new_tokens)
        # Twice what the largest point holds: at exactly its size the scheduler's headroom preempts requests.
        max_len = w.prompt_tokens + new_tokens + bench.block_size
        config = bench.engine_config(name, max_num_seqs=max(args.concurrency), max_model_len=max_len,
                                     device_blocks=2 * needed, host_blocks=needed)  # fmt: skip
        base = bench.describe(name, config)
        logger.info("config %s: building the engine (%s)", name, bench.extra["engines"][name])
        async with progress(f"config {name}", lambda: "building the engine (KV cache, CUDA graphs)"):
            served = await ServedEngine(await asyncio.to_thread(build_core, bench, name, config)).__aenter__()
        bench.extra["weights"][name] = served_weights(served.core.runner.model)
        prefix = w.prefix()
        tokens = bench.tokens.setdefault(name, {})
        async with asyncio.timeout(max(0.0, end - time.monotonic())):
            # Compiles what the first prefill and decode steps need (Triton, FlashInfer) before anything is timed.
            warmup = random_ids(random.Random(f"{args.seed}-warmup"), min(args.warmup_tokens, w.prompt_tokens),
                                w.token_limit)  # fmt: skip
            async with progress(f"config {name}", lambda: "warming up"):
                await stream_request(served.stub, f"{name}-warmup", "warmup", warmup, COLD_OUTPUT_TOKENS)
            logger.info("config %s: cold request (prefill of %d tokens)", name, w.prompt_tokens)
            started = time.perf_counter()
            async with progress(f"config {name}", lambda: "cold request: waiting for its tokens"):
                cold = await stream_request(served.stub, f"{name}-cold", "cold", w.prompt(prefix, "cold"),
                                            COLD_OUTPUT_TOKENS)  # fmt: skip
        tokens["cold"] = cold.tokens
        bench.record({**base, "phase": "cold", "concurrency": 1,
                      **summarize([cold], time.perf_counter() - started)})  # fmt: skip
        # Per-request latency the next point is predicted from: warm TTFT ~ 2 x suffix/prompt of the cold one.
        itl = float(np.median(cold.itls_s)) if cold.itls_s else cold.ttft_s
        warm_ttft_s = 2 * cold.ttft_s * w.suffix_tokens / w.prompt_tokens
        await prime(bench, served, name, warm_ttft_s + COLD_OUTPUT_TOKENS * itl, end)
        estimate = (1, warm_ttft_s + w.output_tokens * itl)
        for concurrency in args.concurrency:
            count = requests_per_point(concurrency, args.requests_per_point)
            predicted = predict_point_s(count, concurrency, *estimate)
            row = {**base, "phase": "warm", "concurrency": concurrency}
            if time.monotonic() + predicted > end:
                logger.warning("config %s, concurrency %d: predicted %.0f s, %.0f s left: skipped", name,
                               concurrency, predicted, end - time.monotonic())  # fmt: skip
                bench.record({**row, "skipped": "budget", "predicted_s": predicted})
                done.add(concurrency)
                continue
            row.update(await measure_point(bench, served, name, concurrency, count, end))
            bench.record(row)
            done.add(concurrency)
            if "e2e_p50_ms" in row:
                estimate = (concurrency, row["e2e_p50_ms"] / 1e3)
    except TimeoutError:  # the cold request did not fit
        logger.warning("config %s: out of budget before its warm points", name)
        for concurrency in [c for c in args.concurrency if c not in done]:
            bench.record({**base, "phase": "warm", "concurrency": concurrency, "skipped": "budget"})
    except Exception as exc:
        logger.exception("config %s failed", name)
        for concurrency in [c for c in args.concurrency if c not in done]:
            bench.record({**base, "phase": "warm", "concurrency": concurrency, "error": describe_error(exc)})
    finally:
        if served is not None:
            await served.__aexit__(None, None, None)
        del served
        free_device_memory(bench.device)


async def prime(bench: Bench, served: ServedEngine, name: str, request_s: float, end: float) -> None:
    """Untimed warm requests (prefix hits), one then a burst as large as the largest point when a quarter of
    the time left allows: the kernels compiled for a prefill over a cached prefix and for wide batches (Triton
    specializes on sizes) would otherwise land in the first point that needs them, as TTFT and ITL spikes."""
    w = bench.workload
    prefix = w.prefix()
    widest = max(bench.args.concurrency)
    bursts = [1]
    if predict_point_s(widest, widest, 1, request_s) < (end - time.monotonic()) / 4:
        bursts.append(widest)
    async with progress(f"config {name}", lambda: f"priming with bursts of {bursts}"):
        for burst in bursts:
            await asyncio.gather(*(
                stream_request(served.stub, f"{name}-prime-{burst}-{i}", "prime",
                               w.prompt(prefix, f"prime-{burst}-{i}"), COLD_OUTPUT_TOKENS)
                for i in range(burst)
            ))  # fmt: skip


async def measure_point(bench: Bench, served: ServedEngine, name: str, concurrency: int, count: int,
                        end: float) -> dict[str, Any]:  # fmt: skip
    """One closed-loop point, run by the clients' process."""
    before, compiles_before = await served.stats(), kernel_compiles.snapshot()
    if bench.client is None or not bench.client.alive:
        bench.client = ClientProcess()
    started, cpu_before = time.perf_counter(), served.cpu_seconds()
    try:
        results, seconds = await bench.client.closed_loop(served.address, f"{name}-c{concurrency}", bench.workload,
                                                          [f"c{concurrency}-{i}" for i in range(count)], concurrency,
                                                          max(0.0, end - time.monotonic()),
                                                          bench.args.engine_stream == "shared")  # fmt: skip
    except TimeoutError:
        seconds = time.perf_counter() - started
        logger.warning("config %s, concurrency %d: cancelled at the budget after %.0f s", name, concurrency, seconds)
        return {"skipped": "budget", "cancelled_after_s": seconds}
    after, compiles, cpu_after = await served.stats(), kernel_compiles.snapshot(), served.cpu_seconds()
    bench.tokens[name].update({r.key: r.tokens for r in results})
    # Kernels the point's steps compiled (the engine runs in this process): each one stalls the whole batch.
    return {**summarize(results, seconds), "preemptions": after.num_preemptions - before.num_preemptions,
            "kernel_compiles": compiles.count - compiles_before.count,
            "kernel_compile_s": compiles.seconds - compiles_before.seconds,
            **host_cpu_per_step(after.num_steps - before.num_steps, cpu_before, cpu_after, seconds),
            **offload_delta(before.offload, after.offload)}  # fmt: skip


def host_cpu_per_step(steps: int, cpu_before: tuple[float, float], cpu_after: tuple[float, float],
                      seconds: float) -> dict[str, float | int]:  # fmt: skip
    """A point's engine steps, wall ms a step, and CPU ms a step of the event loop's thread (the gRPC streams)
    and of the engine thread.  Both threads share the GIL: loop time that grows with the streams delays the
    engine thread's next launch."""
    if steps <= 0:
        return {"engine_steps": max(steps, 0)}
    loop_s, engine_s = (after - before for before, after in zip(cpu_before, cpu_after, strict=True))
    return {"engine_steps": steps, "step_ms": seconds / steps * 1e3, "loop_cpu_ms_per_step": loop_s / steps * 1e3,
            "engine_cpu_ms_per_step": engine_s / steps * 1e3}  # fmt: skip


# --- long context ------------------------------------------------------------------------------------------------


async def run_long(bench: Bench, name: str, share_s: float) -> None:
    """One request with a ``--long-context`` prompt: prefill time, then decode tok/s with CUDA graphs (first third
    of its tokens), eagerly (second third, copies timed) and with graphs again (last third), and the offload
    counters."""
    args = bench.args
    context, new_tokens = args.long_context, args.long_output_tokens
    end = min(time.monotonic() + share_s - TEARDOWN_S, bench.deadline)
    row: dict[str, Any] = {**bench.row_fields(name), "phase": "long", "concurrency": 1, "context": context}
    cold = next((r for r in bench.rows if r["config"] == name and r.get("phase") == "cold"), None)
    # Prefill grows between linearly (MLPs) and quadratically (attention, the MSA indexer) with the context.
    predicted = cold["ttft_p50_ms"] / 1e3 * (context / bench.workload.prompt_tokens) ** 1.5 if cold else 0.0
    if time.monotonic() + predicted >= end:
        bench.record({**row, "skipped": "budget", "predicted_s": predicted})
        return
    served: ServedEngine | None = None
    started = time.perf_counter()
    try:
        max_len = context + new_tokens + bench.block_size
        blocks = bench.blocks(max_len) + 1
        config = bench.engine_config(name, max_num_seqs=1, max_model_len=max_len, device_blocks=blocks,
                                     host_blocks=blocks)  # fmt: skip
        row.update(bench.describe(f"{name}-long", config))
        served = await ServedEngine(await asyncio.to_thread(build_core, bench, name, config)).__aenter__()
        prompt = random_ids(random.Random(f"{args.seed}-long"), context, bench.workload.token_limit)
        before = await served.stats()
        misses_before = await served.engine.run_on_engine_thread(_graph_misses)
        logger.info("config %s: long request (prefill of %d tokens)", name, context)
        started = time.perf_counter()
        async with asyncio.timeout(max(0.0, end - time.monotonic())):
            result, to_eager, to_graphs = await _long_request(served, name, prompt, new_tokens)
        after = await served.stats()
        bench.tokens.setdefault(name, {})["long"] = result.tokens
        row.update({
            "prefill_s": result.ttft_s,
            "output_tokens": len(result.tokens),
            "seconds": time.perf_counter() - started,
            "decode_tok_s": decode_rate(result.token_times, 1, to_eager - 1),
            "eager_decode_tok_s": decode_rate(result.token_times, to_eager + 2, to_graphs - 1),
            "late_graph_decode_tok_s": decode_rate(result.token_times, to_graphs + 2, len(result.tokens) - 1),
            "prefix_hit_rate": result.cached_tokens / result.prompt_tokens,
            # Graph-mode decode steps that ran eagerly instead (and may have compiled kernels mid-request).
            "graph_misses": int(await served.engine.run_on_engine_thread(_graph_misses)) - int(misses_before),
            **offload_delta(before.offload, after.offload),
        })  # fmt: skip
    except TimeoutError:
        row.update({"skipped": "budget", "cancelled_after_s": time.perf_counter() - started})
    except Exception as exc:
        logger.exception("long request on config %s failed", name)
        row["error"] = describe_error(exc)
    finally:
        if served is not None:
            await served.__aexit__(None, None, None)
        del served
        free_device_memory(bench.device)
    bench.record(row)


def _graph_misses(core: EngineCore) -> int:
    return core.runner.num_graph_misses


async def _long_request(served: ServedEngine, name: str, prompt: list[int], new_tokens: int
                        ) -> tuple[RequestResult, int, int]:  # fmt: skip
    """The long request, decoded in thirds: CUDA graphs, eagerly (offload copies timed), CUDA graphs again (so a
    graph-mode rate is seen both right after the prefill and later).  Returns the result and the index of the
    first token each switch may have changed."""
    request_id = f"{name}-long"
    switches: list[asyncio.Future] = []
    received = [0]
    graphs: list = []

    def output_tokens(core: EngineCore) -> int:
        request = core.scheduler.requests.get(request_id)
        return request.num_output_tokens if request is not None else new_tokens

    def go_eager(core: EngineCore) -> int:
        graphs.append(core.runner.decode_graphs)
        core.runner.decode_graphs = None  # from the next step on; the step in flight finishes as captured
        return output_tokens(core)

    def go_graphs(core: EngineCore) -> int:
        core.runner.decode_graphs = graphs[0]
        return output_tokens(core)

    def on_tokens(count: int) -> None:
        # Each switch waits for the previous one to have taken effect plus a third of the tokens: tokens may
        # arrive several to a chunk, which must not let both switches land on the same step.
        received[0] = count
        third = max(1, new_tokens // 3)
        if not switches and count >= third:
            switches.append(asyncio.ensure_future(served.engine.run_on_engine_thread(go_eager)))
        elif len(switches) == 1 and switches[0].done() and count >= switches[0].result() + third:
            switches.append(asyncio.ensure_future(served.engine.run_on_engine_thread(go_graphs)))

    async with progress(f"long {name}", lambda: f"{received[0]} of {new_tokens} tokens (0: still prefilling)"):
        result = await stream_request(served.stub, request_id, "long", prompt, new_tokens, on_tokens)
    at = [int(await switch) for switch in switches] + [new_tokens] * (2 - len(switches))
    return result, at[0], at[1]
