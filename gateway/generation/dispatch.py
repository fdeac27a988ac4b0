"""Open a request's engine streams: route, start the calls, and retry on another engine as long as
no token has come back.

A request with n choices sends n engine requests to one engine (they share the prompt's KV through
its prefix cache).  The calls count as open as soon as they start; ``EngineStream.close`` ends that
and tells the engine's circuit breaker how it went.
"""

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from m3stack.gateway.engine_client import wire
from m3stack.gateway.engine_client.client import EngineClient, GenerateCall, current_task_is_cancelling
from m3stack.gateway.engine_client.events import Completion, EngineEvent
from m3stack.gateway.engine_client.pool import EnginePool
from m3stack.gateway.engine_client.requests import EngineRequest
from m3stack.gateway.errors import engine_failure, invalid_request, no_engine_available
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.gateway.routing.policies import RoutingPolicy

logger = logging.getLogger(__name__)

# Codes after which another engine may well succeed; the first three also count against the breaker.
_ENGINE_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN})
_RETRYABLE = _ENGINE_FAULTS | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


class EngineStreamError(Exception):
    """An engine stream failed after it started; the message is for the client."""


class _RetryElsewhereError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class EngineStream:
    """One open Generate call whose first response has arrived."""

    engine: EngineClient
    request_id: str
    call: GenerateCall
    first: EngineEvent
    dispatcher: "Dispatcher"
    closed: bool = False

    async def read(self) -> EngineEvent:
        """The next response (``first`` came with the call's opening); raises ``EngineStreamError`` if the
        engine fails."""
        try:
            response = await self.call.read()
        except asyncio.CancelledError:
            if current_task_is_cancelling():
                raise
            # The pool cancelled the call: the engine stopped answering health checks.
            raise EngineStreamError(self.engine.down_reason or f"engine {self.engine.address} was lost") from None
        except grpc.aio.AioRpcError as exc:
            raise EngineStreamError(f"engine {self.engine.address} failed: {exc.code().name}: {exc.details()}") from exc
        if response is grpc.aio.EOF:
            raise EngineStreamError(f"engine {self.engine.address} ended the stream without completing the request")
        self.engine.note_response()
        return wire.read_response(response)

    def close(self, outcome: str) -> None:
        """``outcome``: ``completed``, ``failed``, or why we abort it (``client_disconnected``, ``stop_string``...)."""
        if self.closed:
            return
        self.closed = True
        self.engine.end_generate(self.call)
        if outcome == "completed":
            self.engine.record_success()
        elif outcome == "failed":
            self.engine.record_failure()
        else:
            self.call.cancel()
            self.dispatcher.abort_in_background(self.engine, self.request_id, outcome)
            if outcome == "stop_string":
                self.engine.record_success()
            else:
                self.engine.record_abandoned()


class Dispatcher:
    def __init__(self, pool: EnginePool, policy: RoutingPolicy, metrics: GatewayMetrics, max_attempts: int) -> None:
        self._pool = pool
        self._policy = policy
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._background: set[asyncio.Task[None]] = set()

    async def open(self, prompt_ids: Sequence[int], requests: Sequence[EngineRequest]) -> list[EngineStream]:
        """Start ``requests`` (same prompt) on one engine and wait for their first responses."""
        tried: set[str] = set()
        failures: list[str] = []
        for attempt in range(self._max_attempts):
            candidates = [engine for engine in self._pool.routable() if engine.address not in tried]
            if not candidates:
                break
            engine = self._policy.choose(candidates, prompt_ids)
            tried.add(engine.address)
            if attempt > 0:
                self._metrics.engine_retries.inc()
            try:
                streams = await self._open_on(engine, requests)
            except _RetryElsewhereError as exc:
                logger.warning(
                    "engine %s could not take request %s: %s", engine.address, requests[0].request_id, exc.reason
                )
                failures.append(f"{engine.address}: {exc.reason}")
                continue
            self._policy.on_routed(engine, prompt_ids)
            logger.debug("%s: %d engine requests on %s", requests[0].request_id, len(requests), engine.address)
            return streams
        if not failures:
            detail = "no engine is ready" if not self._pool.engines else "no engine is ready or every breaker is open"
        else:
            detail = "; ".join(failures)
        raise no_engine_available(self._pool.seconds_until_retry(), detail)

    async def _open_on(self, engine: EngineClient, requests: Sequence[EngineRequest]) -> list[EngineStream]:
        calls = [engine.start_generate(request) for request in requests]
        try:
            if len(calls) == 1:  # most requests: no gather, which would wrap the read in a task
                firsts = [await _first_response(calls[0])]
            else:
                firsts = await asyncio.gather(*(call.read() for call in calls), return_exceptions=True)
        except BaseException:  # our task was cancelled (client gone) while the engine queued the request
            for request, call in zip(requests, calls, strict=True):
                self._abandon(engine, call, request.request_id, "client_disconnected")
            raise
        error = next((first for first in firsts if isinstance(first, BaseException)), None)
        if error is None:
            engine.note_response()
            firsts = [first if first is grpc.aio.EOF else wire.read_response(first) for first in firsts]
            aborted = [first for first in firsts if first is grpc.aio.EOF or _is_engine_abort(first)]
            if aborted:
                error = _RetryElsewhereError("the engine aborted the request before its first token (draining?)")
        if error is not None:
            for request, call in zip(requests, calls, strict=True):
                self._abandon(engine, call, request.request_id, "retry")
            raise self._classify(engine, error)
        return [
            EngineStream(engine, request.request_id, call, first, self)
            for request, call, first in zip(requests, calls, firsts, strict=True)
        ]

    def _classify(self, engine: EngineClient, error: BaseException) -> BaseException:
        if isinstance(error, _RetryElsewhereError):
            return error
        if isinstance(error, asyncio.CancelledError):  # the pool cancelled the call: engine went down
            engine.record_failure()
            return _RetryElsewhereError(engine.down_reason or "the engine was lost")
        if not isinstance(error, grpc.aio.AioRpcError):
            return error
        code, details = error.code(), error.details() or ""
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return invalid_request(f"The engine rejected the request: {details}")
        if code in _ENGINE_FAULTS:
            engine.record_failure()
        if code in _RETRYABLE:
            return _RetryElsewhereError(f"{code.name}: {details}")
        engine.record_failure()
        return engine_failure(f"engine {engine.address} failed: {code.name}: {details}")

    def _abandon(self, engine: EngineClient, call: GenerateCall, request_id: str, reason: str) -> None:
        engine.end_generate(call)
        engine.record_abandoned()
        call.cancel()
        self.abort_in_background(engine, request_id, reason)

    def abort_in_background(self, engine: EngineClient, request_id: str, reason: str) -> None:
        """Cancelling the call aborts the request; the Abort RPC also reaches it if it is still queued."""
        self._metrics.engine_aborts.labels(reason=reason).inc()
        task = asyncio.get_running_loop().create_task(engine.abort(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _first_response(call: GenerateCall) -> object:
    """What ``asyncio.gather(call.read(), return_exceptions=True)`` gives for one call: the response, or
    the error reading it (also the call's cancellation by the pool); only our own cancellation raises."""
    try:
        return await call.read()
    except asyncio.CancelledError as exc:
        if current_task_is_cancelling():
            raise
        return exc
    except Exception as exc:
        return exc


def _is_engine_abort(first: EngineEvent) -> bool:
    return isinstance(first, Completion) and first.finish_reason == "abort"
