"""Agentic serving benchmark: closed-loop gRPC clients against the real engine server, four engine configs.

The engine is built in this process around one random-weight model (M3 attention dims, ``--layers`` layers,
dense MLPs: ``bench.engine_step.build_model``; ``--model tiny`` takes the embedded tiny checkpoint for CPU
runs) and served by the real gRPC server (``AsyncEngine`` + ``GrpcServer``) on a free loopback port; the
clients run in a spawned process of their own.  The configs differ only in their ``EngineConfig``:

* ``a``: the optimized engine (``attention="msa"``: Triton MSA kernels, FlashInfer; on cpu ``--msa-attention``
  defaults to ``auto``, the reference backend, since the kernels only run interpreted there);
* ``b``: the same engine with every layer dense (``attention="dense"``);
* ``c``: the naive MSA path (``attention="naive"``: reference gather + query-major, plain PyTorch);
* ``d``: ``a`` with CPU KV offload: a pinned host pool and ``--offload-device-blocks`` device blocks (default:
  the prefix + half the largest point's own blocks + one hot buffer), prefill chunks capped to fit them.

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
counters.  ``extra`` holds the ratios a/c, a/b, d/a per concurrency, the targets, and greedy agreement.

Budget: ``--budget-s`` wall seconds from the start.  Each config (a long run counts half) gets an equal share
of what is left; a point whose predicted time does not fit its config's share is recorded as
``{"skipped": "budget"}``, one that overruns is cancelled and recorded the same way.  ``serving.json`` is
rewritten after every point; a config that fails records ``"error"`` in its rows and the others still run.
``serving.svg`` plots the warm points (matplotlib is not in the environment).

    python -m bench.serving [--out DIR] [--budget-s 600] [--configs a,b,c,d] [--concurrency 1,2,4,8,16,32,64]
    python -m bench.serving --budget-s 230 --configs a,b,d,c --concurrency 1,4,16,64 --output-tokens 128 \
        --requests-per-point 2 --long-context 262144 --long-output-tokens 128      # ~4 minutes on the H200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import math
import multiprocessing
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from bench.common import markdown_table, write_results
from m3stack.engine.offload.metrics import OffloadStats
from m3stack.engine.proto import engine_pb2 as pb
from m3stack.engine.proto import engine_pb2_grpc
from m3stack.engine.runtime.config import EngineConfig
from m3stack.gateway.engines.client import CHANNEL_OPTIONS

# torch and the engine are imported where they are used: the client process imports this module without them.
if TYPE_CHECKING:
    import torch

    from m3stack.engine.model.config import M3Config
    from m3stack.engine.model.model import M3ForServing
    from m3stack.engine.runtime.engine_core import EngineCore, EngineStats

logger = logging.getLogger("bench.serving")

CONFIGS = {  # name -> (attention, CPU KV offload)
    "a": ("msa", False),
    "b": ("dense", False),
    "c": ("naive", False),
    "d": ("msa", True),
}
LONG_WEIGHT = 0.5  # a long run's budget share relative to a config's serving points
COLD_OUTPUT_TOKENS = 8
TEARDOWN_S = 3.0  # kept back from each share: stopping the server, freeing the KV cache
FINAL_S = 2.0  # kept back from the whole budget: the last write
STATS_PERIOD_S = 0.26  # the offload copies its device counters to the host at most every 0.25 s (engine.offload)
PROGRESS_S = 10.0
CLIENT_GRACE_S = 30.0  # past a point's deadline, how long the clients' process may take to answer


# --- workload ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    token_limit: int  # prompt ids are drawn from [0, token_limit): below the image/video placeholders
    seed: int = 0

    def prefix(self) -> list[int]:
        return _random_ids(random.Random(f"{self.seed}-prefix"), self.prefix_tokens, self.token_limit)

    def prompt(self, prefix: list[int], key: str) -> list[int]:
        """The shared prefix plus a suffix unique to ``key`` (the same in every config)."""
        return prefix + _random_ids(random.Random(f"{self.seed}-{key}"), self.suffix_tokens, self.token_limit)

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens


def _random_ids(rng: random.Random, count: int, limit: int) -> list[int]:
    return [rng.randrange(limit) for _ in range(count)]


def requests_per_point(concurrency: int, minimum: int) -> int:
    return max(concurrency, minimum)


# --- one streamed request -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    key: str
    tokens: list[int]
    ttft_s: float
    itls_s: list[float]  # one per token after the first: the chunk gap divided by its tokens
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    token_times: list[float]  # perf_counter when each token arrived


async def stream_request(stub: engine_pb2_grpc.EngineStub, request_id: str, key: str, prompt: list[int],
                         max_new_tokens: int, on_tokens: Callable[[int], None] | None = None
                         ) -> RequestResult:  # fmt: skip
    """One greedy Generate call read to its end; raises ``RuntimeError`` unless it ran to ``max_new_tokens``.
    ``on_tokens`` sees the count of tokens received after each chunk."""
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    message = pb.GenerateRequest(request_id=request_id, input_ids=prompt, sampling=sampling)
    start = time.perf_counter()
    tokens: list[int] = []
    times: list[float] = []
    itls: list[float] = []
    complete = None
    async for response in stub.Generate(message):
        now = time.perf_counter()
        if response.HasField("chunk"):
            count = len(response.chunk.token_ids)
            if times:
                itls += [(now - times[-1]) / count] * count
            tokens += response.chunk.token_ids
            times += [now] * count
            if on_tokens is not None:
                on_tokens(len(tokens))
        else:
            complete = response.complete
    if complete is None or complete.finish_reason != pb.FINISH_REASON_LENGTH or len(tokens) != max_new_tokens:
        reason = "no completion" if complete is None else pb.FinishReason.Name(complete.finish_reason)
        raise RuntimeError(f"{request_id} ended with {reason} after {len(tokens)} of {max_new_tokens} tokens")
    return RequestResult(key, tokens, times[0] - start, itls, time.perf_counter() - start, complete.prompt_tokens,
                         complete.cached_tokens, times)  # fmt: skip


async def closed_loop(stub: engine_pb2_grpc.EngineStub, tag: str, prompts: list[tuple[str, list[int]]],
                      concurrency: int, max_new_tokens: int) -> list[RequestResult]:  # fmt: skip
    """``concurrency`` clients, each sending the next prompt as soon as its previous request finished."""
    pending = iter(prompts)
    results: list[RequestResult] = []

    async def client() -> None:
        for key, prompt in pending:  # one shared iterator: each client takes the next prompt
            results.append(await stream_request(stub, f"{tag}-{key}", key, prompt, max_new_tokens))

    # A failed request cancels the other clients (TaskGroup): nothing of the point outlives it.
    async with progress(tag, lambda: f"{len(results)}/{len(prompts)} requests done"), asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    return results


@contextlib.asynccontextmanager
async def progress(tag: str, state: Callable[[], str]) -> AsyncIterator[None]:
    """Logs ``state()`` every ``PROGRESS_S`` seconds while the body runs."""
    start = time.monotonic()

    async def report() -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            logger.info("%s: %s after %.0f s", tag, state(), time.monotonic() - start)

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        task.cancel()


# --- the clients' process ----------------------------------------------------------------------------------------


class ClientProcess:
    """The closed-loop clients in a process of their own (spawned: it imports neither torch nor the engine), so
    their Python work takes no GIL time from the engine thread and the server, as with a real load generator."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_client_main, args=(child,), name="bench-serving-client", daemon=True)
        self._process.start()
        child.close()
        self.alive = True

    async def closed_loop(self, address: str, tag: str, workload: Workload, keys: list[str], concurrency: int,
                          timeout_s: float) -> tuple[list[RequestResult], float]:  # fmt: skip
        """The requests' results and the point's wall seconds; ``TimeoutError`` once it ran ``timeout_s``."""
        self._conn.send((address, tag, workload, keys, concurrency, timeout_s))
        try:
            answer = await asyncio.wait_for(asyncio.to_thread(self._conn.recv), timeout_s + CLIENT_GRACE_S)
        except TimeoutError:
            self.close()  # it did not stop at its deadline: the next point gets a fresh one
            raise
        status, payload, seconds = answer
        if status != "done":
            raise TimeoutError if status == "timeout" else RuntimeError(payload)
        return payload, seconds

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


def _client_main(conn: Connection) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s (clients): %(message)s")
    asyncio.run(_serve_points(conn))


async def _serve_points(conn: Connection) -> None:
    """Runs each point the benchmark sends (None: stop) and sends back ``(status, results or message, seconds)``."""
    address, channel = "", None
    prefixes: dict[Workload, list[int]] = {}
    while (command := await asyncio.to_thread(conn.recv)) is not None:
        point_address, tag, workload, keys, concurrency, timeout_s = command
        if point_address != address:  # a new config's engine
            if channel is not None:
                await channel.close()
            address, channel = point_address, grpc.aio.insecure_channel(point_address, options=CHANNEL_OPTIONS)
        prefix = prefixes.setdefault(workload, workload.prefix())
        prompts = [(key, workload.prompt(prefix, key)) for key in keys]
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                stub = engine_pb2_grpc.EngineStub(channel)
                answer = ("done", await closed_loop(stub, tag, prompts, concurrency, workload.output_tokens))
        except TimeoutError:
            answer = ("timeout", None)
        except Exception as exc:
            answer = ("error", _describe(exc))
        conn.send((*answer, time.perf_counter() - started))
    if channel is not None:
        await channel.close()


# --- summaries (pure) -------------------------------------------------------------------------------------------


def percentiles_ms(values: list[float], name: str) -> dict[str, float | None]:
    have = bool(values)
    return {f"{name}_p{q}_ms": float(np.percentile(values, q)) * 1e3 if have else None for q in (50, 90, 99)}


def summarize(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    output = sum(len(r.tokens) for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "requests": len(results),
        "output_tokens": output,
        "seconds": seconds,
        "output_tok_s": output / seconds if seconds > 0 else None,
        **percentiles_ms([r.ttft_s for r in results], "ttft"),
        **percentiles_ms([x for r in results for x in r.itls_s], "itl"),
        "e2e_p50_ms": float(np.median([r.e2e_s for r in results])) * 1e3 if results else None,
        "prefix_hit_rate": sum(r.cached_tokens for r in results) / prompt if prompt else None,
    }


def offload_delta(before: OffloadStats | None, after: OffloadStats | None) -> dict[str, Any]:
    """The offload counters' change between two snapshots: hot-buffer hit rate, bytes moved, copy rates."""
    if before is None or after is None:
        return {}
    d = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(OffloadStats)}
    lookups = d["hot_hits"] + d["hot_misses"]
    return {
        "offload_hit_rate": d["hot_hits"] / lookups if lookups else None,
        "offload_spilled_blocks": d["spilled_blocks"],
        "offload_spill_bytes": d["spill_bytes"],
        "offload_miss_bytes": d["miss_bytes"],
        "offload_staged_bytes": d["staged_bytes"],
        "offload_churn_rate": d["churned_blocks"] / d["selected_blocks"] if d["selected_blocks"] else None,
        # Timed copies only (eager steps: a replayed CUDA graph's copies cannot be timed).
        "offload_miss_gbps": d["timed_miss_bytes"] / d["miss_copy_seconds"] / 1e9 if d["miss_copy_seconds"] else None,
        "offload_stall_s": d["miss_copy_seconds"],
        "offload_staging_gbps": d["timed_staged_bytes"] / d["staging_seconds"] / 1e9 if d["staging_seconds"] else None,
        "host_blocks_used": after.host_blocks_used,
    }


def predict_point_s(requests: int, concurrency: int, last_concurrency: int, last_e2e_s: float) -> float:
    """Wall time of a closed-loop point: requests per client x the last point's request latency, grown with the
    batch (the naive path's decode steps grow about linearly with it, the others' less: this errs towards
    skipping a point rather than cancelling it halfway)."""
    return math.ceil(requests / concurrency) * last_e2e_s * max(1.0, concurrency / last_concurrency)


def decode_rate(times: list[float], first: int, last: int) -> float | None:
    """Tokens per second between token ``first`` and token ``last`` (indices into arrival times)."""
    last = min(last, len(times) - 1)
    if last <= first or times[last] <= times[first]:
        return None
    return (last - first) / (times[last] - times[first])


def ratios(rows: list[dict[str, Any]], numerator: str, denominator: str) -> dict[str, float]:
    """``numerator`` / ``denominator`` output tok/s per concurrency measured for both (warm points)."""
    rate = {(r["config"], r["concurrency"]): r.get("output_tok_s") for r in rows if r.get("phase") == "warm"}
    return {
        str(c): rate[(numerator, c)] / rate[(denominator, c)]
        for (name, c) in rate
        if name == numerator and rate.get((numerator, c)) and rate.get((denominator, c))
    }


def target_report(rows: list[dict[str, Any]], workload: Workload, concurrencies: list[int]) -> dict[str, Any]:
    """Each target: met (True/False), or None where a peer is missing (with what was measured)."""
    a_c, a_b = ratios(rows, "a", "c"), ratios(rows, "a", "b")
    copy_rates = [r["offload_miss_gbps"] for r in rows if r.get("offload_miss_gbps")]
    every = [str(c) for c in concurrencies]
    long_enough = workload.prompt_tokens >= 60_000
    return {
        "a_over_c_ge_1.8_every_concurrency": all(a_c[c] >= 1.8 for c in every) if set(every) <= set(a_c) else None,
        "a_over_b_ge_2_at_60k": all(v >= 2.0 for v in a_b.values()) if a_b and long_enough else None,
        "offload_miss_copy_ge_40_gbps": min(copy_rates) >= 40.0 if copy_rates else None,
    }


# --- the engine under test ----------------------------------------------------------------------------------------


class ServedEngine:
    """An ``EngineCore`` behind the real gRPC server on a free loopback port, and a client channel to it."""

    def __init__(self, core: EngineCore) -> None:
        from m3stack.engine.server.async_engine import AsyncEngine
        from m3stack.engine.server.grpc_server import GrpcServer, GrpcSettings

        self.core = core
        self.engine = AsyncEngine(core)
        self.server = GrpcServer(self.engine, GrpcSettings(host="127.0.0.1", port=0))
        self.address = ""
        self.channel: grpc.aio.Channel | None = None
        self.stub: engine_pb2_grpc.EngineStub | None = None

    async def __aenter__(self) -> ServedEngine:
        self.engine.start()
        self.address = f"127.0.0.1:{await self.server.start()}"
        self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
        await self.server.stop(0.5)
        await self.engine.stop()

    async def stats(self) -> EngineStats:
        """Engine statistics with the offload's device counters up to date (they reach the host lazily)."""
        if self.core.offload is not None and self.core.runner.device.type == "cuda":
            await asyncio.sleep(STATS_PERIOD_S)  # then a read starts a copy of the counters, the next takes it
            await self.engine.run_on_engine_thread(lambda core: core.stats())
            await asyncio.sleep(0.01)
        return await self.engine.run_on_engine_thread(lambda core: core.stats())


@dataclasses.dataclass
class Bench:
    """What every config shares: the model, the workload, the flags, the budget clock and the results so far."""

    args: argparse.Namespace
    model: M3ForServing
    m3: M3Config
    device: torch.device
    dtype: torch.dtype
    workload: Workload
    deadline: float  # time.monotonic() by which everything must be written
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tokens: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)  # config -> key -> tokens
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    client: ClientProcess | None = None

    @property
    def block_size(self) -> int:
        return self.m3.text.index_block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def prefix_blocks(self) -> int:
        """Blocks of the shared prefix that requests share (full ones only)."""
        return self.workload.prefix_tokens // self.block_size

    def own_blocks(self, new_tokens: int) -> int:
        """Blocks a warm request holds alone: its suffix, its output and the prefix's partial last block."""
        return self.blocks(self.workload.prompt_tokens + new_tokens) - self.prefix_blocks

    def offload_device_blocks(self) -> int:
        """Device blocks of the offload configs: the shared prefix, half the largest point's own blocks, and one
        hot buffer, so the largest points run short of device memory."""
        if self.args.offload_device_blocks:
            return self.args.offload_device_blocks
        own = self.own_blocks(self.workload.output_tokens)
        return self.prefix_blocks + math.ceil(max(self.args.concurrency) * own / 2) + self.hot_blocks()

    def hot_blocks(self) -> int:
        """Device pages of one request's hot buffer (engine.offload's default)."""
        from m3stack.engine.offload.assembly import OffloadSettings, resolve_hot_blocks

        return resolve_hot_blocks(OffloadSettings(1.0), self.m3.text)

    def engine_config(self, name: str, *, max_num_seqs: int, max_model_len: int, device_blocks: int,
                      host_blocks: int) -> EngineConfig:  # fmt: skip
        from m3stack.engine.offload.layout import host_bytes_per_block

        offload_gb, chunk = 0.0, self.args.max_num_batched_tokens
        if CONFIGS[name][1]:
            device_blocks = self.offload_device_blocks()
            spec = self.model.kv_cache_spec(self.dtype)
            offload_gb = self.args.offload_gb or (host_blocks + 1) * host_bytes_per_block(spec) / 2**30
            # A prefill chunk must fit the free device blocks: blocks spill only once computed, and a first chunk
            # larger than the device would wait for admission forever.
            room = (device_blocks - self.hot_blocks()) // 4
            chunk = min(chunk, max(1, room) * self.block_size)
        return EngineConfig(device=self.device.type, dtype=str(self.dtype).removeprefix("torch."),
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, max_model_len=max_model_len,
                            num_kv_blocks=device_blocks, attention=self.attention(name), kv_offload_gb=offload_gb,
                            seed=self.args.seed)  # fmt: skip

    def attention(self, name: str) -> str:
        attention = CONFIGS[name][0]
        return self.args.msa_attention if attention == "msa" else attention

    def describe(self, name: str, config: EngineConfig) -> dict[str, Any]:
        """The row fields naming the config, and (in ``extra["engines"]``) its settings that differ from defaults."""
        default = EngineConfig()
        self.extra["engines"][name] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                       if getattr(config, f.name) != getattr(default, f.name)}  # fmt: skip
        return {"config": name.removesuffix("-long"), "attention": config.attention,
                "offload": config.kv_offload_gb > 0}  # fmt: skip

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        logger.info("%s", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        self.save()

    def save(self) -> Path:
        self.extra["elapsed_s"] = self.args.budget_s - (self.deadline + FINAL_S - time.monotonic())
        return write_results("serving", self.rows, self.extra, out_dir=self.args.out)


def build_core(bench: Bench, config: EngineConfig) -> EngineCore:
    from m3stack.engine.runtime.builder import assemble_engine_core

    core = assemble_engine_core(config, bench.model, bench.m3, model_path=bench.extra["model"], device=bench.device,
                                dtype=bench.dtype)  # fmt: skip
    if core.offload is not None:
        core.offload.timing = True  # CUDA-event timing of the copies of eager steps (H2D GB/s)
    return core


def free_device_memory(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- one config ----------------------------------------------------------------------------------------------------


async def run_config(bench: Bench, name: str, share_s: float) -> None:
    """Cold request, then one closed-loop point per concurrency, within ``share_s`` seconds."""
    args, w = bench.args, bench.workload
    end = min(time.monotonic() + share_s - TEARDOWN_S, bench.deadline)
    base = {"config": name, "attention": bench.attention(name), "offload": CONFIGS[name][1]}
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
            served = await ServedEngine(await asyncio.to_thread(build_core, bench, config)).__aenter__()
        prefix = w.prefix()
        tokens = bench.tokens.setdefault(name, {})
        async with asyncio.timeout(max(0.0, end - time.monotonic())):
            # Compiles what the first prefill and decode steps need (Triton, FlashInfer) before anything is timed.
            warmup = _random_ids(random.Random(f"{args.seed}-warmup"), min(args.warmup_tokens, w.prompt_tokens),
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
            bench.record({**base, "phase": "warm", "concurrency": concurrency, "error": _describe(exc)})
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
    before = await served.stats()
    if bench.client is None or not bench.client.alive:
        bench.client = ClientProcess()
    started = time.perf_counter()
    try:
        results, seconds = await bench.client.closed_loop(served.address, f"{name}-c{concurrency}", bench.workload,
                                                          [f"c{concurrency}-{i}" for i in range(count)], concurrency,
                                                          max(0.0, end - time.monotonic()))  # fmt: skip
    except TimeoutError:
        seconds = time.perf_counter() - started
        logger.warning("config %s, concurrency %d: cancelled at the budget after %.0f s", name, concurrency, seconds)
        return {"skipped": "budget", "cancelled_after_s": seconds}
    after = await served.stats()
    bench.tokens[name].update({r.key: r.tokens for r in results})
    return {**summarize(results, seconds), "preemptions": after.num_preemptions - before.num_preemptions,
            **offload_delta(before.offload, after.offload)}  # fmt: skip


# --- long context ------------------------------------------------------------------------------------------------


async def run_long(bench: Bench, name: str, share_s: float) -> None:
    """One request with a ``--long-context`` prompt: prefill time, then decode tok/s with CUDA graphs (first half
    of its tokens) and eagerly (second half, copies timed), and the offload counters."""
    args = bench.args
    context, new_tokens = args.long_context, args.long_output_tokens
    end = min(time.monotonic() + share_s - TEARDOWN_S, bench.deadline)
    row: dict[str, Any] = {"config": name, "attention": bench.attention(name), "offload": CONFIGS[name][1],
                           "phase": "long", "concurrency": 1, "context": context}  # fmt: skip
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
        served = await ServedEngine(await asyncio.to_thread(build_core, bench, config)).__aenter__()
        prompt = _random_ids(random.Random(f"{args.seed}-long"), context, bench.workload.token_limit)
        before = await served.stats()
        logger.info("config %s: long request (prefill of %d tokens)", name, context)
        started = time.perf_counter()
        async with asyncio.timeout(max(0.0, end - time.monotonic())):
            result, switched = await _long_request(served, name, prompt, new_tokens)
        after = await served.stats()
        bench.tokens.setdefault(name, {})["long"] = result.tokens
        row.update({
            "prefill_s": result.ttft_s,
            "output_tokens": len(result.tokens),
            "seconds": time.perf_counter() - started,
            "decode_tok_s": decode_rate(result.token_times, 1, switched - 1),
            "eager_decode_tok_s": decode_rate(result.token_times, switched + 2, len(result.tokens) - 1),
            "prefix_hit_rate": result.cached_tokens / result.prompt_tokens,
            **offload_delta(before.offload, after.offload),
        })  # fmt: skip
    except TimeoutError:
        row.update({"skipped": "budget", "cancelled_after_s": time.perf_counter() - started})
    except Exception as exc:
        logger.exception("long request on config %s failed", name)
        row["error"] = _describe(exc)
    finally:
        if served is not None:
            await served.__aexit__(None, None, None)
        del served
        free_device_memory(bench.device)
    bench.record(row)


async def _long_request(served: ServedEngine, name: str, prompt: list[int], new_tokens: int
                        ) -> tuple[RequestResult, int]:  # fmt: skip
    """The long request, switched to eager decode (offload copies timed) after half its tokens; returns the
    result and the index of the first token an eager step may have produced."""
    request_id = f"{name}-long"
    switch: list[asyncio.Future] = []
    received = [0]

    def go_eager(core: EngineCore) -> int:
        core.runner.decode_graphs = None  # from the next step on; the step in flight finishes as captured
        request = core.scheduler.requests.get(request_id)
        return request.num_output_tokens if request is not None else new_tokens

    def on_tokens(count: int) -> None:
        received[0] = count
        if count >= new_tokens // 2 and not switch:
            switch.append(asyncio.ensure_future(served.engine.run_on_engine_thread(go_eager)))

    async with progress(f"long {name}", lambda: f"{received[0]} of {new_tokens} tokens (0: still prefilling)"):
        result = await stream_request(served.stub, request_id, "long", prompt, new_tokens, on_tokens)
    return result, int(await switch[0]) if switch else new_tokens


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


# --- plot (pure) --------------------------------------------------------------------------------------------------

_COLORS = {"a": "#1f77b4", "b": "#ff7f0e", "c": "#2ca02c", "d": "#d62728"}
_PANELS = (("output tok/s", "output_tok_s"), ("TTFT p50 (ms)", "ttft_p50_ms"), ("ITL p50 (ms)", "itl_p50_ms"))


def svg_plot(rows: list[dict[str, Any]], title: str) -> str:
    """Warm points per config against concurrency (log2 axis): one panel per metric of ``_PANELS``."""
    width, height, left, top, inner_w, inner_h = 330, 260, 55, 30, 250, 180
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(_PANELS)}" height="{height + 30}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="10" y="16" font-size="13">{title}</text>',
    ]
    warm = [r for r in rows if r.get("phase") == "warm"]
    levels = sorted({r["concurrency"] for r in warm}) or [1]
    lo, hi = math.log2(levels[0]), math.log2(levels[-1]) if levels[-1] > levels[0] else math.log2(levels[0]) + 1
    for panel, (label, key) in enumerate(_PANELS):
        x0, y0 = panel * width + left, top + 20
        points = [r for r in warm if isinstance(r.get(key), int | float)]
        peak = max((r[key] for r in points), default=1.0) * 1.1 or 1.0

        def xy(concurrency: int, value: float, x0: float = x0, y0: float = y0, peak: float = peak) -> str:
            x = x0 + (math.log2(concurrency) - lo) / (hi - lo) * inner_w
            return f"{x:.1f},{y0 + inner_h - value / peak * inner_h:.1f}"

        parts.append(f'<rect x="{x0}" y="{y0}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#888"/>')
        parts.append(f'<text x="{x0}" y="{y0 - 6}">{label}</text>')
        for c in levels:
            x = xy(c, 0).split(",")[0]
            parts.append(f'<text x="{x}" y="{y0 + inner_h + 14}" text-anchor="middle">{c}</text>')
        for fraction in (0.0, 0.5, 1.0):
            y = y0 + inner_h - fraction * inner_h
            parts.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{peak * fraction:.3g}</text>')
        for index, config in enumerate(sorted({r["config"] for r in points})):
            color = _COLORS.get(config, "#555")
            series = sorted((r["concurrency"], r[key]) for r in points if r["config"] == config)
            coords = " ".join(xy(c, v) for c, v in series)
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
            parts += [f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="3" fill="{color}"/>'
                      for p in coords.split()]  # fmt: skip
            parts.append(f'<text x="{x0 + 8 + 40 * index}" y="{y0 + inner_h + 30}" fill="{color}">{config}</text>')
        parts.append(f'<text x="{x0 + inner_w / 2}" y="{y0 + inner_h + 44}" text-anchor="middle">concurrency</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# --- driver -------------------------------------------------------------------------------------------------------


def load_model(args: argparse.Namespace, device: torch.device, max_len: int
               ) -> tuple[M3ForServing, M3Config, torch.dtype, str]:  # fmt: skip
    """The benchmark model (``--model``) with a position limit of at least ``max_len``; its dtype and a name."""
    import torch

    if args.model == "tiny":
        from m3stack.engine.model.loader import load_model as load_checkpoint
        from m3stack.engine.model.tiny import ensure_tiny_checkpoint

        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model, m3 = load_checkpoint(ensure_tiny_checkpoint(), device, dtype)
        name = "tiny-random"
    else:
        from bench.engine_step import build_model

        model, m3 = build_model(args.layers, False, device)
        dtype, name = torch.bfloat16, f"random-m3-dims-{args.layers}-layers"
    if max_len > m3.text.max_position_embeddings:  # RoPE angles are computed per step: no table to outgrow
        m3 = dataclasses.replace(m3, text=dataclasses.replace(m3.text, max_position_embeddings=max_len))
    return model, m3, dtype, name


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="folder for serving.json / serving.svg (bench/results)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--model",
        choices=("m3dims", "tiny"),
        default="m3dims",
        help="m3dims: random bf16 weights at M3 attention dims; tiny: the embedded tiny checkpoint",
    )
    p.add_argument("--layers", type=int, default=8, help="m3dims layers (one dense-attention layer, then MSA)")
    p.add_argument("--configs", type=_config_list, default=list(CONFIGS), help="a,b,c,d (run in this order)")
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
    })  # fmt: skip
    _note_offload(bench)
    if args.device == "cpu" and args.msa_attention != "msa":
        logger.warning("on cpu, configs a and d use attention=%s (the Triton kernels run only interpreted there)",
                       args.msa_attention)  # fmt: skip
    asyncio.run(_run_units(bench))
    bench.extra["ratios"] = {"a_over_c": ratios(bench.rows, "a", "c"), "a_over_b": ratios(bench.rows, "a", "b"),
                             "d_over_a": ratios(bench.rows, "d", "a")}  # fmt: skip
    long = {r["config"]: r.get("decode_tok_s") for r in bench.rows if r.get("phase") == "long"}
    if long.get("d") and long.get("a"):
        bench.extra["ratios"]["long_decode_d_over_a"] = long["d"] / long["a"]
    bench.extra["targets"] = target_report(bench.rows, workload, args.concurrency)
    # Same prompts, greedy: c and d should give a's tokens up to bf16 near ties (b attends every token: it differs).
    bench.extra["greedy_agreement"] = {
        f"{name}_vs_a": _agreement(bench.tokens.get("a", {}), tokens) for name, tokens in bench.tokens.items()
        if name in ("c", "d")
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


def _agreement(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, int]:
    keys = sorted(set(reference) & set(other))
    return {"requests": len(keys), "equal": sum(reference[k] == other[k] for k in keys)}


async def _run_units(bench: Bench) -> None:
    args = bench.args
    units: list[tuple[str, float, Callable]] = [(name, 1.0, run_config) for name in args.configs]
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


def _write_plot(bench: Bench) -> str:
    from bench.common import RESULTS_DIR

    path = (bench.args.out or RESULTS_DIR) / "serving.svg"  # by hand: matplotlib is not in the environment
    w = bench.workload
    title = (f"{bench.extra['model']}: {w.prefix_tokens} shared + {w.suffix_tokens} own prompt tokens, "
             f"{w.output_tokens} out")  # fmt: skip
    path.write_text(svg_plot(bench.rows, title))
    return path.name


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bench = run(argv)
    ratio_rows = [{"concurrency": c, **{k: v.get(str(c)) for k, v in bench.extra["ratios"].items()
                                        if isinstance(v, dict)}} for c in bench.args.concurrency]  # fmt: skip
    columns = ["config", "phase", "concurrency", "requests", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "prefix_hit_rate", "preemptions", "offload_hit_rate",
               "offload_spilled_blocks", "skipped", "error"]  # fmt: skip
    long_columns = [
        "config",
        "context",
        "prefill_s",
        "decode_tok_s",
        "eager_decode_tok_s",
        "offload_hit_rate",
        "offload_miss_gbps",
        "offload_staging_gbps",
        "offload_spilled_blocks",
        "skipped",
        "error",
    ]
    serving = [r for r in bench.rows if r.get("phase") != "long"]
    long = [r for r in bench.rows if r.get("phase") == "long"]
    sys.stdout.write(
        f"targets: {bench.extra['targets']}\n\n"
        + markdown_table(ratio_rows, list(ratio_rows[0]))
        + "\n\n"
        + markdown_table(long, long_columns)
        + "\n\n"
        + markdown_table(serving, columns)
        + "\n"
    )
    return 1 if any("error" in r for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
