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
from m3stack.gateway.engine_client.client import CHANNEL_OPTIONS
from m3stack.proto import engine_pb2 as pb
from m3stack.proto import engine_pb2_grpc

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


_STATUS_NAMES = {status.value[0]: status.name for status in grpc.StatusCode}


class _Reader:
    """One request's responses as they arrive, into a ``RequestResult``."""

    def __init__(self, request_id: str, key: str, max_new_tokens: int, on_tokens: Callable[[int], None] | None):
        self.request_id, self.key, self.max_new_tokens, self.on_tokens = request_id, key, max_new_tokens, on_tokens
        self.start = time.perf_counter()
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.itls: list[float] = []
        self.complete: pb.GenerateComplete | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        now = time.perf_counter()
        if response.HasField("chunk"):
            count = len(response.chunk.token_ids)
            if self.times:
                self.itls += [(now - self.times[-1]) / count] * count
            self.tokens += response.chunk.token_ids
            self.times += [now] * count
            if self.on_tokens is not None:
                self.on_tokens(len(self.tokens))
        elif response.HasField("error"):
            code = _STATUS_NAMES.get(response.error.code, str(response.error.code))
            raise RuntimeError(f"{self.request_id} failed: {code}: {response.error.message}")
        else:
            self.complete = response.complete

    def result(self) -> RequestResult:
        """Raises ``RuntimeError`` unless the request ran to ``max_new_tokens``."""
        complete, tokens = self.complete, self.tokens
        if complete is None or complete.finish_reason != pb.FINISH_REASON_LENGTH or len(tokens) != self.max_new_tokens:
            reason = "no completion" if complete is None else pb.FinishReason.Name(complete.finish_reason)
            raise RuntimeError(f"{self.request_id} ended with {reason} after {len(tokens)} of {self.max_new_tokens} "
                               "tokens")  # fmt: skip
        return RequestResult(self.key, tokens, self.times[0] - self.start, self.itls, time.perf_counter() - self.start,
                             complete.prompt_tokens, complete.cached_tokens, self.times)  # fmt: skip


def _generate_request(request_id: str, prompt: list[int], max_new_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, input_ids=prompt, sampling=sampling)


async def stream_request(stub: engine_pb2_grpc.EngineStub, request_id: str, key: str, prompt: list[int],
                         max_new_tokens: int, on_tokens: Callable[[int], None] | None = None
                         ) -> RequestResult:  # fmt: skip
    """One greedy Generate call read to its end; raises ``RuntimeError`` unless it ran to ``max_new_tokens``.
    ``on_tokens`` sees the count of tokens received after each chunk."""
    reader = _Reader(request_id, key, max_new_tokens, on_tokens)
    async for response in stub.Generate(_generate_request(request_id, prompt, max_new_tokens)):
        reader.add(response)
    return reader.result()


class SharedStream:
    """Requests over one ``GenerateStream`` call (the engine batches every request's responses of a wakeup into
    one message), each read as ``stream_request`` reads its own call."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._starts: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
        self._readers: dict[str, asyncio.Queue[pb.GenerateResponse]] = {}
        self._call = stub.GenerateStream(self._inputs())
        self._demux = asyncio.create_task(self._read())

    async def _inputs(self) -> AsyncIterator[pb.GenerateStreamRequest]:
        while (message := await self._starts.get()) is not None:
            yield message

    async def _read(self) -> None:
        async for message in self._call:
            for response in message.responses:
                self._readers[response.request_id].put_nowait(response)

    async def stream_request(self, request_id: str, key: str, prompt: list[int], max_new_tokens: int
                             ) -> RequestResult:  # fmt: skip
        reader = _Reader(request_id, key, max_new_tokens, None)
        responses: asyncio.Queue[pb.GenerateResponse] = asyncio.Queue()
        self._readers[request_id] = responses
        self._starts.put_nowait(pb.GenerateStreamRequest(start=_generate_request(request_id, prompt, max_new_tokens)))
        try:
            while reader.complete is None:
                if self._demux.done():  # the call ended: its error, or an end without this request's completion
                    self._demux.result()
                    break
                getter = asyncio.ensure_future(responses.get())
                await asyncio.wait({getter, self._demux}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    reader.add(getter.result())
                else:
                    getter.cancel()
        finally:
            del self._readers[request_id]
        return reader.result()

    async def close(self) -> None:
        self._starts.put_nowait(None)
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._demux


async def closed_loop(stub: engine_pb2_grpc.EngineStub, tag: str, prompts: list[tuple[str, list[int]]],
                      concurrency: int, max_new_tokens: int, shared_stream: bool = False
                      ) -> list[RequestResult]:  # fmt: skip
    """``concurrency`` clients, each sending the next prompt as soon as its previous request finished; with
    ``shared_stream`` all of them over one ``GenerateStream`` call, else each request on its own ``Generate``."""
    pending = iter(prompts)
    results: list[RequestResult] = []
    shared = SharedStream(stub) if shared_stream else None

    async def client() -> None:
        for key, prompt in pending:  # one shared iterator: each client takes the next prompt
            request_id = f"{tag}-{key}"
            if shared is not None:
                results.append(await shared.stream_request(request_id, key, prompt, max_new_tokens))
            else:
                results.append(await stream_request(stub, request_id, key, prompt, max_new_tokens))

    # A failed request cancels the other clients (TaskGroup): nothing of the point outlives it.
    try:
        async with progress(tag, lambda: f"{len(results)}/{len(prompts)} requests done"), asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client())
    finally:
        if shared is not None:
            await shared.close()
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
                          timeout_s: float, shared_stream: bool = False
                          ) -> tuple[list[RequestResult], float]:  # fmt: skip
        """The requests' results and the point's wall seconds; ``TimeoutError`` once it ran ``timeout_s``."""
        self._conn.send((address, tag, workload, keys, concurrency, timeout_s, shared_stream))
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
        point_address, tag, workload, keys, concurrency, timeout_s, shared_stream = command
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
                answer = ("done", await closed_loop(stub, tag, prompts, concurrency, workload.output_tokens,
                                                    shared_stream))  # fmt: skip
        except TimeoutError:
            answer = ("timeout", None)
        except Exception as exc:
            answer = ("error", describe_error(exc))
        conn.send((*answer, time.perf_counter() - started))
    if channel is not None:
        await channel.close()
