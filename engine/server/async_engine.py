"""Drive an ``EngineCore`` from its own thread and expose it to asyncio code (the gRPC servicer).

The step loop runs on a dedicated thread so a forward pass never blocks the event loop.  Requests
and aborts travel to it through a command queue that it drains before every step, so an abort (or
a cancelled stream) frees the request's blocks before the next forward.  Each step's outputs come
back in one ``call_soon_threadsafe`` and are routed to each request's sink: an asyncio queue behind
``generate``, or whatever ``submit`` was given (a multiplexed stream's buffer).
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from m3stack.engine.runtime.engine_core import EngineCore, EngineStats, StepReport
from m3stack.engine.runtime.errors import DuplicateRequestError, EngineError, EngineUnavailableError
from m3stack.engine.runtime.request import Request, RequestOutput, SamplingParams
from m3stack.engine.runtime.validation import build_request

logger = logging.getLogger(__name__)

HEALTH_REQUEST_PREFIX = "__health__-"
# Idle wait between checks for commands; bounds how long stop() takes.
_IDLE_POLL_S = 0.1


class OutputSink(Protocol):
    def put_nowait(self, output: RequestOutput, /) -> None:
        """Called on the event loop's thread with each output of the request, in order."""


@dataclass
class _Add:
    request: Request
    bypass_queue_limit: bool


@dataclass
class _Abort:
    request_id: str
    message: str


@dataclass
class _Call:
    function: Callable[[EngineCore], object]
    future: concurrent.futures.Future


class StepObserver:
    """Receives engine events on the engine thread (metrics); the default does nothing."""

    def on_request_added(self, request: Request) -> None:
        pass

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Every output the engine publishes (tokens, finishes, aborts, errors)."""

    def on_step(self, report: StepReport) -> None:
        pass

    def on_stats(self, stats: EngineStats) -> None:
        """The core's statistics after every step and every batch of commands."""


class AsyncEngine:
    def __init__(self, core: EngineCore, observer: StepObserver | None = None) -> None:
        self.core = core
        self.info = core.info
        self.observer = observer or StepObserver()
        self.stats: EngineStats = core.stats()  # replaced by the engine thread after each step
        self.draining = False
        self.fatal_error: str | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._streams: dict[str, OutputSink] = {}  # live requests, until their consumer releases them
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def thread_cpu_seconds(self) -> float:
        """CPU seconds the engine thread has used so far (0 before it starts): with the event loop's own
        (``time.thread_time()`` on its thread), how the host's work splits between stepping and serving."""
        if self._thread is None or self._thread.ident is None:
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    # --- requests -------------------------------------------------------------------------------

    async def generate(
        self, request: Request, *, bypass_queue_limit: bool = False
    ) -> AsyncIterator[list[RequestOutput]]:
        """Yield the request's outputs until it finishes; raises ``EngineError`` when it fails.

        Each item holds every output that arrived since the previous one (a slow reader gets several
        steps' tokens at once).  Leaving the iteration early (the client cancelled) aborts the request.
        """
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(request, stream, bypass_queue_limit=bypass_queue_limit)
        finished = False
        try:
            while not finished:
                outputs = [await stream.get()]
                while not stream.empty():
                    outputs.append(stream.get_nowait())
                for output in outputs:
                    if output.error is not None:
                        finished = True
                        raise output.error
                    finished = finished or output.finished
                yield outputs
        finally:
            self.release(request.request_id, finished)

    def submit(self, request: Request, sink: OutputSink, *, bypass_queue_limit: bool = False) -> None:
        """Start ``request``: its outputs go to ``sink.put_nowait`` on the event loop's thread, the last one
        finished or carrying an error.  The caller then calls ``release``; until then the request counts as
        live (``drain`` waits for it).  Raises ``EngineError`` when the engine admits nothing."""
        if self.fatal_error is not None:
            raise EngineUnavailableError(f"the engine stopped after an internal error: {self.fatal_error}")
        if self.draining and not bypass_queue_limit:
            raise EngineUnavailableError("the engine is draining and admits no new requests")
        if request.request_id in self._streams:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already running")
        self._streams[request.request_id] = sink
        add = _Add(request, bypass_queue_limit)
        if request.grammar is not None and not request.grammar.ready:
            # Handed to the engine thread once its grammar compiled (or failed to: add_request then refuses it).
            request.grammar.add_done_callback(lambda: self._commands.put(add))
        else:
            self._commands.put(add)

    def release(self, request_id: str, finished: bool) -> None:
        """The consumer is done with a submitted request; one that has not finished is aborted."""
        self._streams.pop(request_id, None)
        if not finished:
            self._commands.put(_Abort(request_id, "the client cancelled the request"))

    def abort(self, request_id: str, message: str) -> bool:
        """Abort a live request; its stream ends with finish reason ABORT.  False when no such request lives."""
        if request_id not in self._streams:
            return False
        self._commands.put(_Abort(request_id, message))
        return True

    async def run_on_engine_thread(self, function: Callable[[EngineCore], object]) -> object:
        """Call ``function(core)`` on the engine thread between two steps (consistent views, e.g. invariants)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(function, future))
        return await asyncio.wrap_future(future)

    async def health_check(self, timeout_s: float) -> tuple[bool, str, float]:
        """Run a one-token generation through the scheduler: (healthy, message, latency in ms)."""
        start = time.perf_counter()

        def elapsed_ms() -> float:
            return (time.perf_counter() - start) * 1e3

        token = self.info.bos_token_id if self.info.bos_token_id is not None else 0
        request = build_request(
            self.info,
            f"{HEALTH_REQUEST_PREFIX}{uuid.uuid4().hex}",
            [token],
            SamplingParams(temperature=0.0, max_new_tokens=1),
            priority=-(2**31),
        )
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self.generate(request, bypass_queue_limit=True):
                    pass
        except TimeoutError:
            return False, f"the one-token forward did not finish within {timeout_s:.1f}s", elapsed_ms()
        except EngineError as exc:
            return False, exc.message, elapsed_ms()
        if self.draining:
            return False, "the engine is draining", elapsed_ms()
        return True, "ok", elapsed_ms()

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, let live requests finish until the deadline, then abort the rest; returns how many."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._streams)
        for request_id in leftover:
            self.abort(request_id, f"the engine is shutting down (drain deadline of {timeout_s:g}s reached)")
        # Let the aborted streams deliver their final message before the server closes them.
        flush_deadline = time.monotonic() + 5.0
        while self._streams and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)
        return len(leftover)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(wait=not self.core.has_work)
                if not self.core.has_work:
                    continue
                report = self.core.step()
                self.observer.on_step(report)
                self._refresh_stats()
                if report.outputs:
                    self._publish(report.outputs)
        except Exception as exc:  # a bug in the scheduler itself: fail every stream, refuse new work
            logger.exception("the engine loop stopped")
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            self._call_in_loop(self._fail_all_streams)

    def _apply_commands(self, wait: bool) -> None:
        outputs = []
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add) and command.request.request_id not in self._streams:
                pass  # released while its grammar compiled: nobody waits for it
            elif isinstance(command, _Add):
                try:
                    self.core.add_request(command.request, bypass_queue_limit=command.bypass_queue_limit)
                    self.observer.on_request_added(command.request)
                except EngineError as exc:
                    outputs.append(RequestOutput(command.request.request_id, error=exc))
            elif isinstance(command, _Abort):
                output = self.core.abort_request(command.request_id, command.message)
                if output is not None:
                    outputs.append(output)
            else:
                try:
                    command.future.set_result(command.function(self.core))
                except Exception as exc:
                    command.future.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._refresh_stats()
        if outputs:
            self._publish(outputs)

    def _refresh_stats(self) -> None:
        self.stats = self.core.stats()
        self.observer.on_stats(self.stats)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.observer.on_outputs(outputs)
        self._call_in_loop(self._dispatch, outputs)

    def _call_in_loop(self, callback: Callable, *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closing: nobody is listening any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all_streams(self) -> None:
        error = EngineError(f"the engine stopped after an internal error: {self.fatal_error}")
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(RequestOutput(request_id, error=error))
