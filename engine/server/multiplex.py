"""One ``GenerateStream`` call: many requests over one gRPC stream, their responses batched per wakeup.

A per-request ``Generate`` stream costs the server one gRPC message per request per step, and that
per-message machinery (~40 us a message on a 2-core CPU) runs on the GIL the engine thread needs to
launch the next step.  Here the engine's outputs for every request of the stream land in one buffer,
and each wakeup of the writer sends everything ready as one ``GenerateStreamResponse``.  Each request's
responses are those ``Generate`` would send, in the same order; a request the engine refuses or fails
gets a response with ``error`` (the status code ``Generate`` would end with) instead of ending the call.
"""

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from m3stack.engine.runtime.errors import EngineError
from m3stack.engine.runtime.request import Request, RequestOutput
from m3stack.engine.server.async_engine import AsyncEngine
from m3stack.engine.server.convert import responses_from_outputs
from m3stack.logs import request_context
from m3stack.proto import engine_pb2 as pb


def error_response(request_id: str, status: grpc.StatusCode, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, error=pb.GenerateError(code=status.value[0], message=message))


class MultiplexedStream:
    """The requests of one ``GenerateStream`` call and what is ready to send them.

    ``put_nowait`` (the requests' output sink, on the event loop) only appends and wakes the writer,
    so a step's outputs for N requests cost N list appends and one wakeup.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        build: Callable[[pb.GenerateRequest], Request],
        status_of: Callable[[EngineError], grpc.StatusCode],
    ) -> None:
        self._engine = engine
        self._build = build
        self._status_of = status_of
        self._live: set[str] = set()  # submitted, final response not yet sent
        self._ready: dict[str, list[RequestOutput]] = {}  # outputs not yet sent, by request, in arrival order
        self._refusals: list[pb.GenerateResponse] = []
        self._wakeup = asyncio.Event()
        self._inputs_done = False

    # --- the engine's side: the requests' sink -------------------------------------------------

    def put_nowait(self, output: RequestOutput) -> None:
        self._ready.setdefault(output.request_id, []).append(output)
        self._wakeup.set()

    # --- the client's side ---------------------------------------------------------------------

    async def read_inputs(self, inputs: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        """Start and abort requests as the client sends them; returns when the client half-closes."""
        try:
            async for message in inputs:
                kind = message.WhichOneof("request")
                if kind == "start":
                    self._start(message.start)
                elif kind == "abort" and message.abort.request_id in self._live:
                    self._engine.abort(message.abort.request_id, message.abort.reason or "aborted by the caller")
        finally:
            self._inputs_done = True
            self._wakeup.set()

    def _start(self, request: pb.GenerateRequest) -> None:
        try:
            with request_context(request.metadata.get("x-request-id")):  # log lines of its build and admission
                self._engine.submit(self._build(request), self)
        except EngineError as exc:
            self._refusals.append(error_response(request.request_id, self._status_of(exc), exc.message))
            self._wakeup.set()
            return
        self._live.add(request.request_id)

    async def responses(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Everything ready at each wakeup, until the client has half-closed and every request has ended."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            message = self._take_ready()
            if message.responses:
                yield message
            if self._inputs_done and not self._live and not self._refusals and not self._ready:
                return

    def _take_ready(self) -> pb.GenerateStreamResponse:
        message = pb.GenerateStreamResponse(responses=self._refusals)
        self._refusals = []
        ready, self._ready = self._ready, {}
        for request_id, outputs in ready.items():
            failed = next((index for index, output in enumerate(outputs) if output.error is not None), None)
            if failed is not None:  # what Generate sends: the tokens before the error, then its status
                error = outputs[failed].error
                status, text = (self._status_of(error), error.message) if isinstance(error, EngineError) else (
                    grpc.StatusCode.INTERNAL, str(error))  # fmt: skip
                if any(output.new_token_ids for output in outputs[:failed]):
                    message.responses.extend(responses_from_outputs(request_id, outputs[:failed]))
                message.responses.append(error_response(request_id, status, text))
                self._end(request_id, finished=True)
                continue
            message.responses.extend(responses_from_outputs(request_id, outputs))
            if outputs[-1].finished:
                self._end(request_id, finished=True)
        return message

    def _end(self, request_id: str, finished: bool) -> None:
        self._live.discard(request_id)
        self._engine.release(request_id, finished)

    def close(self) -> None:
        """The call ended (the client went away, or we did): abort what still runs."""
        for request_id in list(self._live):
            self._end(request_id, finished=False)
