"""The load generator: one streamed gRPC request, a closed loop of them, and the process they run in.

This module and what it imports stay free of torch and the engine: the spawned clients' process imports this
module, nothing more of the benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection

import grpc

from bench.serving.workload import Workload
from m3stack.engine.proto import engine_pb2 as pb
from m3stack.engine.proto import engine_pb2_grpc
from m3stack.gateway.engines.client import CHANNEL_OPTIONS

logger = logging.getLogger("bench.serving")

PROGRESS_S = 10.0
CLIENT_GRACE_S = 30.0  # past a point's deadline, how long the clients' process may take to answer


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


def describe_error(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


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
            answer = ("error", describe_error(exc))
        conn.send((*answer, time.perf_counter() - started))
    if channel is not None:
        await channel.close()
