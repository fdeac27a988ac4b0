"""Gateway overhead: the same streamed requests through the gateway (HTTP + tokenize + route + relay)
and straight to the engine (gRPC with token ids), side by side, at concurrency 1 and 64.

The engine is a stub that speaks engine.proto and streams canned tokens in decode steps of a fixed
length (every running request gets its token at each step, as with continuous batching), so that
the only difference between the two paths is the gateway.  The direct path runs twice: with a Generate
call per request, and over one shared ``GenerateStream`` as the gateway calls the engine by default (the
gateway's overhead is taken against the latter; against the former it would include the shared stream's
own gain).  A third path, the relay floor, goes through a minimal relay built from the gateway's
libraries (uvicorn with uvloop and httptools, one grpc.aio channel) that forwards each engine token as a
fixed SSE event and does nothing else: what any Python relay costs here, to tell the libraries' share of
the overhead from the gateway's own work.  Four processes (stub engine, gateway, relay floor, this load
generator) share the machine.  Run:

    python -m bench.gateway_overhead [--out DIR]

Writes ``bench/results/gateway_overhead.json``: per concurrency and path, TTFT and end-to-end latency
p50/p99, CPU per request of each process, and the overhead rows (gateway minus either direct path, floor
minus direct).  Target: p50 end-to-end overhead < 2 ms at concurrency 64.
"""

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.common import write_results
from m3stack.gateway.cli import KEEP_ALIVE_TIMEOUT_S
from m3stack.gateway.engine_client.shared_stream import SharedStream
from m3stack.proto import engine_pb2, engine_pb2_grpc

logger = logging.getLogger("bench.gateway_overhead")

LOOPBACK = "127.0.0.1"
STUB_CONTEXT = 8192
PROMPT = (
    "Serving a large language model means batching requests, caching keys and values, and streaming tokens "
    "to the user. Sparse attention selects the blocks of the context that matter most for each query. "
) * 4


# ------------------------------------------------------------------------------------------------
# The stub engine


class StepClock:
    """An engine's decode loop: a step of ``interval_s`` gives every request waiting for a token its
    token at once (continuous batching), so their chunks leave together as a real engine's do.  A step
    starts when the first request waits for it: an idle engine serves a new request right away."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._tick: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting = asyncio.Event()
        self.running = 0

    async def run(self) -> None:
        while True:
            await self._waiting.wait()
            await asyncio.sleep(self._interval_s)
            self._waiting.clear()
            tick, self._tick = self._tick, asyncio.get_running_loop().create_future()
            tick.set_result(None)

    async def next_step(self) -> None:
        self._waiting.set()
        await asyncio.shield(self._tick)


class StubEngine(engine_pb2_grpc.EngineServicer):
    """Streams ``max_new_tokens`` canned tokens, one per step of the clock."""

    def __init__(self, token_ids: list[int], clock: StepClock, vocab_size: int) -> None:
        self._tokens = token_ids
        self._clock = clock
        self._vocab_size = vocab_size

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        async for response in self._responses(request):
            yield response

    async def GenerateStream(self, request_iterator, context):  # noqa: N802
        """The gateway's shared stream: a step's responses of every request on the call in one message, as the
        engine batches them (engine.server.multiplex)."""
        ready: list[engine_pb2.GenerateResponse] = []
        wakeup = asyncio.Event()
        running: dict[str, asyncio.Task[None]] = {}

        async def run(request: engine_pb2.GenerateRequest) -> None:
            try:
                async for response in self._responses(request):
                    ready.append(response)
                    wakeup.set()
            finally:
                running.pop(request.request_id, None)

        async def read_inputs() -> None:
            async for message in request_iterator:
                if message.WhichOneof("request") == "start":
                    running[message.start.request_id] = asyncio.create_task(run(message.start))
                elif (task := running.get(message.abort.request_id)) is not None:
                    task.cancel()

        reader = asyncio.create_task(read_inputs())
        reader.add_done_callback(lambda _: wakeup.set())
        try:
            while not (reader.done() and not running and not ready):
                await wakeup.wait()
                wakeup.clear()
                if ready:
                    batch, ready[:] = list(ready), []
                    yield engine_pb2.GenerateStreamResponse(responses=batch)
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _responses(self, request: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """``max_new_tokens`` canned tokens, one per step, then the completion."""
        count = request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens") else 16
        prompt = len(request.input_ids)
        self._clock.running += 1
        try:
            for index in range(count):
                await self._clock.next_step()
                token = self._tokens[index % len(self._tokens)]
                yield engine_pb2.GenerateResponse(
                    request_id=request.request_id,
                    chunk=engine_pb2.GenerateChunk(
                        token_ids=[token], prompt_tokens=prompt, completion_tokens=index + 1
                    ),
                )
            yield engine_pb2.GenerateResponse(
                request_id=request.request_id,
                complete=engine_pb2.GenerateComplete(
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH, prompt_tokens=prompt, completion_tokens=count
                ),
            )
        finally:
            self._clock.running -= 1

    async def Abort(self, request, context):  # noqa: N802
        return engine_pb2.AbortResponse(found=False)

    async def HealthCheck(self, request, context):  # noqa: N802
        return engine_pb2.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request, context):  # noqa: N802
        return engine_pb2.ModelInfo(
            served_model_name="stub", max_context_length=STUB_CONTEXT, vocab_size=self._vocab_size, kv_block_size=16
        )

    async def GetLoads(self, request, context):  # noqa: N802
        return engine_pb2.Loads(num_running=self._clock.running)


async def serve_stub(port: int, model_dir: Path, interval_s: float) -> None:
    from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer.from_folder(model_dir)
    canned = tokenizer.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    clock = StepClock(interval_s)
    steps = asyncio.create_task(clock.run())
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(StubEngine(canned, clock, tokenizer.vocab_size), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    await server.wait_for_termination()
    steps.cancel()


def write_tokenizer_folder(folder: Path) -> Path:
    """The tiny default model's tokenizer and chat template (no weights: the gateway needs none)."""
    from m3stack.engine.model.tiny_tokenizer import build_tiny_tokenizer, chat_template

    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "]~!b[", "eos_token": "[e~["}))
    (folder / "chat_template.jinja").write_text(chat_template())
    return folder


# ------------------------------------------------------------------------------------------------
# The relay floor

FLOOR_EVENT = (
    b'data: {"id":"cmpl-floor","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,'
    b'"text":" the","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)


def relay_floor_app(engine_address: str, prompt_ids: list[int]) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app: read the JSON body, stream ``max_tokens`` from the engine with the prompt's ids
    (tokenized once, up front), send one fixed event per token, then the usage and [DONE]."""
    stubs: list[engine_pb2_grpc.EngineStub] = []
    counter = iter(range(1 << 62))

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # readiness
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if not stubs:
            stubs.append(engine_pb2_grpc.EngineStub(grpc.aio.insecure_channel(engine_address)))
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        sampling = engine_pb2.SamplingParams(max_new_tokens=json.loads(body)["max_tokens"])
        request = engine_pb2.GenerateRequest(
            request_id=f"floor-{next(counter)}", input_ids=prompt_ids, sampling=sampling
        )
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        count = 0
        async for response in stubs[0].Generate(request):
            if response.HasField("chunk"):
                count += len(response.chunk.token_ids)
                await send({"type": "http.response.body", "body": FLOOR_EVENT, "more_body": True})
        usage = b'data: {"id":"cmpl-floor","choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % count
        await send({"type": "http.response.body", "body": usage, "more_body": False})

    return app


def serve_floor(port: int, engine_port: int, model_dir: Path) -> None:
    import uvicorn

    from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

    prompt_ids = ModelTokenizer.from_folder(model_dir).encode(PROMPT, add_special_tokens=True)
    app = relay_floor_app(f"{LOOPBACK}:{engine_port}", prompt_ids)
    # The gateway's idle keep-alive, so that neither server closes a connection the load generator may reuse.
    uvicorn.run(app, host=LOOPBACK, port=port, log_level="warning", lifespan="off",
                timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Load generation


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    e2e_s: float
    tokens: int


async def direct_request(stub: engine_pb2_grpc.EngineStub, prompt_ids: list[int], tokens: int, index: int) -> Sample:
    start = time.perf_counter()
    first = 0.0
    received = 0
    request = engine_pb2.GenerateRequest(
        request_id=f"direct-{index}", input_ids=prompt_ids, sampling=engine_pb2.SamplingParams(max_new_tokens=tokens)
    )
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            received += len(response.chunk.token_ids)
            if not first:
                first = time.perf_counter()
    return Sample(first - start, time.perf_counter() - start, received)


async def direct_shared_request(shared: SharedStream, prompt_ids: list[int], tokens: int, index: int) -> Sample:
    """The engine called directly the way the gateway calls it: every request over one ``GenerateStream``."""
    start = time.perf_counter()
    first = 0.0
    received = 0
    request = engine_pb2.GenerateRequest(
        request_id=f"direct-shared-{index}",
        input_ids=prompt_ids,
        sampling=engine_pb2.SamplingParams(max_new_tokens=tokens),
    )
    call = shared.start(request)
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.HasField("chunk"):
            received += len(response.chunk.token_ids)
            if not first:
                first = time.perf_counter()
    return Sample(first - start, time.perf_counter() - start, received)


async def gateway_request(session, url: str, tokens: int, index: int) -> Sample:
    body = {
        "model": "stub",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = 0.0
    received = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not first and line.startswith(b'data: {"id"'):
                first = time.perf_counter()
            elif line.startswith(b"data: {") and b'"usage":{' in line:
                received = json.loads(line[len(b"data: ") :])["usage"]["completion_tokens"]
    return Sample(first - start, time.perf_counter() - start, received)


async def run_closed_loop(send: Callable[[int], Awaitable[Sample]], concurrency: int, total: int) -> list[Sample]:
    samples: list[Sample] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < total:
            index = next_index
            next_index += 1
            samples.append(await send(index))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarize(path: str, concurrency: int, samples: list[Sample]) -> dict[str, float | int | str]:
    ttft = [s.ttft_s * 1e3 for s in samples]
    e2e = [s.e2e_s * 1e3 for s in samples]
    return {
        "concurrency": concurrency,
        "path": path,
        "requests": len(samples),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "e2e_p50_ms": statistics.median(e2e),
        "e2e_p99_ms": percentile(e2e, 0.99),
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuMeter:
    """CPU time each process (stub engine, gateway, relay floor, and this load generator) spends per
    request, per path.  The load generator's share shows whether the paths cost the client alike (HTTP
    and SSE parsing for two, gRPC for the direct one) on the cores the gateway runs on."""

    pids: dict[str, int]
    seconds: dict[tuple[str, str], float]

    def _now(self) -> dict[str, float]:
        return {**{name: process_cpu_s(pid) for name, pid in self.pids.items()}, "loadgen": time.process_time()}

    async def run(self, path: str, work: Awaitable[list[Sample]]) -> list[Sample]:
        before = self._now()
        samples = await work
        after = self._now()
        for process in before:
            key = (path, process)
            self.seconds[key] = self.seconds.get(key, 0.0) + after[process] - before[process]
        return samples


async def measure(
    args: argparse.Namespace, ports: dict[str, int], prompt_ids: list[int], pids: dict[str, int]
) -> list[dict]:
    import aiohttp

    rows: list[dict] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        grpc.aio.insecure_channel(f"{LOOPBACK}:{ports['engine']}") as channel,
    ):
        stub = engine_pb2_grpc.EngineStub(channel)
        shared = SharedStream(stub, f"{LOOPBACK}:{ports['engine']}")

        def direct(index: int) -> Awaitable[Sample]:
            return direct_request(stub, prompt_ids, args.tokens, index)

        def direct_shared(index: int) -> Awaitable[Sample]:
            return direct_shared_request(shared, prompt_ids, args.tokens, index)

        def over_http(process: str) -> Callable[[int], Awaitable[Sample]]:
            url = f"http://{LOOPBACK}:{ports[process]}/v1/completions"
            return lambda index: gateway_request(session, url, args.tokens, index)

        paths = {
            "direct": direct,
            "direct shared stream": direct_shared,
            "gateway": over_http("gateway"),
            "floor": over_http("floor"),
        }
        for concurrency in args.concurrency:
            total = max(args.min_requests, concurrency * args.waves)
            for send in paths.values():
                await run_closed_loop(send, concurrency, concurrency * 2)  # warm-up
            # Alternate the paths in rounds so that noise from other work on the machine hits them all.
            collected: dict[str, list[Sample]] = {path: [] for path in paths}
            meter = CpuMeter(pids, seconds={})
            for _ in range(args.rounds):
                for path, send in paths.items():
                    collected[path] += await meter.run(path, run_closed_loop(send, concurrency, total // args.rounds))
            for samples in collected.values():
                short = [s for s in samples if s.tokens != args.tokens]
                if short:
                    raise RuntimeError(f"{len(short)} requests did not receive exactly {args.tokens} tokens")
            summaries = {path: summarize(path, concurrency, samples) for path, samples in collected.items()}
            for row in summaries.values():
                for process in (*pids, "loadgen"):
                    row[f"{process}_cpu_ms_per_request"] = 1e3 * meter.seconds[(row["path"], process)] / row["requests"]
            rows += summaries.values()
            # The gateway calls the engine over a shared stream (its default) and the floor with a call per
            # request: each against the direct client that calls the engine the same way.
            for path, baseline in (("gateway", "direct shared stream"), ("gateway", "direct"), ("floor", "direct")):
                row, direct_row = summaries[path], summaries[baseline]
                overhead = {
                    "concurrency": concurrency,
                    "path": f"overhead ({path} - {baseline})",
                    "requests": row["requests"],
                    **{key: row[key] - direct_row[key] for key in direct_row if key.endswith("_ms")},
                    f"{path}_cpu_ms_per_request": row[f"{path}_cpu_ms_per_request"],
                }
                rows.append(overhead)
                logger.info("concurrency %d: %s", concurrency, json.dumps(overhead))
        shared.close()
    return rows


def wait_ready(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout_s}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per response")
    parser.add_argument("--token-interval-ms", type=float, default=20.0, help="stub engine decode step")
    parser.add_argument("--waves", type=int, default=24, help="requests per path = concurrency * waves")
    parser.add_argument("--min-requests", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=12, help="the paths alternate this many times")
    parser.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.serve_stub is not None:
        asyncio.run(serve_stub(args.serve_stub, args.model_dir, args.token_interval_ms / 1e3))
        return
    if args.serve_floor is not None:
        serve_floor(args.serve_floor, args.engine_port, args.model_dir)
        return

    from m3stack.gateway.tokenize.tokenizer import ModelTokenizer
    from m3stack.local.processes import free_port

    with tempfile.TemporaryDirectory(prefix="m3stack-bench-") as tmp:
        model_dir = write_tokenizer_folder(Path(tmp) / "stub")
        prompt_ids = ModelTokenizer.from_folder(model_dir).encode(PROMPT, add_special_tokens=True)
        ports = {process: free_port(LOOPBACK) for process in ("engine", "gateway", "floor")}
        engine = f"{LOOPBACK}:{ports['engine']}"
        bench = [sys.executable, "-m", "bench.gateway_overhead", "--model-dir", str(model_dir)]
        gateway = [sys.executable, "-m", "m3stack", "gateway", "--model", str(model_dir), "--engines", engine]
        children = {
            "engine": subprocess.Popen(
                [*bench, "--serve-stub", str(ports["engine"]), "--token-interval-ms", str(args.token_interval_ms)]
            ),
            "gateway": subprocess.Popen(
                [*gateway, "--port", str(ports["gateway"])], env={**os.environ, "M3STACK_LOG_LEVEL": "WARNING"}
            ),
            "floor": subprocess.Popen(
                [*bench, "--serve-floor", str(ports["floor"]), "--engine-port", str(ports["engine"])]
            ),
        }
        try:
            for process in ("gateway", "floor"):
                wait_ready(f"http://{LOOPBACK}:{ports[process]}/ready", 60)
            load_before = os.getloadavg()[0]
            pids = {process: child.pid for process, child in children.items()}
            rows = asyncio.run(measure(args, ports, prompt_ids, pids))
            load_after = os.getloadavg()[0]
        finally:
            for child in children.values():
                child.terminate()
            for child in children.values():
                child.wait(timeout=30)
    settings = {
        "tokens_per_request": args.tokens,
        "stub_token_interval_ms": args.token_interval_ms,
        "prompt_tokens": len(prompt_ids),
        # Other work on the machine competes for its cores: the one-minute load average around the run.
        "load_average_before_after": [load_before, load_after],
        "target": "p50 end-to-end overhead < 2 ms at concurrency 64",
    }
    write_results("gateway_overhead", rows, extra={"settings": settings}, out_dir=args.out)


if __name__ == "__main__":
    main()
