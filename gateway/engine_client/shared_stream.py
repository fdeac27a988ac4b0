"""The gateway's requests to one engine over one ``GenerateStream`` call.

The engine then sends one message per wakeup carrying every ready response of our requests, instead
of one message per request per step (gRPC's per-message cost, paid on the engine's event loop, whose
thread shares the GIL with the engine's step loop).  Each request gets a ``MultiplexedCall`` with the
surface of the ``grpc.aio.UnaryStreamCall`` a per-request ``Generate`` returns (``read()``, ``cancel()``,
``AioRpcError`` with the engine's status code, ``EOF`` after the completion), so routing, retries and
streaming to the client do not change.  If the shared call fails, every request on it fails as its own
call would (``UNAVAILABLE``), and the next request opens a new shared call.
"""

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from m3stack.proto import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


class MultiplexedCall:
    """One request on a ``SharedStream``, read like a per-request ``Generate`` call."""

    def __init__(self, stream: "SharedStream", request_id: str) -> None:
        self._stream = stream
        self.request_id = request_id
        self._responses: asyncio.Queue[engine_pb2.GenerateResponse | BaseException] = asyncio.Queue()
        self._ended = False  # the completion (or an error) has been read
        self._cancelled = False

    def deliver(self, item: engine_pb2.GenerateResponse | BaseException) -> None:
        self._responses.put_nowait(item)

    async def read(self) -> engine_pb2.GenerateResponse | object:
        """The next response; ``grpc.aio.EOF`` after the completion; ``AioRpcError`` for an engine error or the
        shared call's failure; ``CancelledError`` once cancelled (as a cancelled gRPC call raises)."""
        if self._cancelled:
            raise asyncio.CancelledError
        if self._ended:
            return grpc.aio.EOF
        item = await self._responses.get()
        if isinstance(item, BaseException):
            self._ended = True
            self._stream.forget(self.request_id)
            raise item
        if item.HasField("error"):
            self._ended = True
            self._stream.forget(self.request_id)
            raise _rpc_error(_STATUS_BY_VALUE.get(item.error.code, grpc.StatusCode.UNKNOWN), item.error.message)
        if item.HasField("complete"):
            self._ended = True
            self._stream.forget(self.request_id)
        return item

    def cancel(self) -> bool:
        """Stop reading; the engine aborts the request (as when a per-request call is cancelled)."""
        if self._cancelled:
            return False
        self._cancelled = True
        if not self._ended:
            self._stream.abort(self.request_id, "the gateway cancelled the request")
        self._responses.put_nowait(asyncio.CancelledError())  # wakes a pending read(), which then raises
        return True


class SharedStream:
    """One ``GenerateStream`` call to an engine and the requests open on it."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub, address: str) -> None:
        self._address = address
        self._outbox: asyncio.Queue[engine_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self._calls: dict[str, MultiplexedCall] = {}
        self._call = stub.GenerateStream(self._inputs())
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.closed = False

    def start(self, request: engine_pb2.GenerateRequest) -> MultiplexedCall:
        call = MultiplexedCall(self, request.request_id)
        self._calls[request.request_id] = call
        self._outbox.put_nowait(engine_pb2.GenerateStreamRequest(start=request))
        return call

    def abort(self, request_id: str, reason: str) -> None:
        if not self.closed:
            abort = engine_pb2.AbortRequest(request_id=request_id, reason=reason)
            self._outbox.put_nowait(engine_pb2.GenerateStreamRequest(abort=abort))
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    async def _inputs(self) -> AsyncIterator[engine_pb2.GenerateStreamRequest]:
        while (message := await self._outbox.get()) is not None:  # None: closed, the generator ends
            yield message

    async def _read(self) -> None:
        failure = "the engine ended the shared stream"
        try:
            async for message in self._call:
                for response in message.responses:
                    call = self._calls.get(response.request_id)
                    if call is not None:
                        call.deliver(response)
        except grpc.aio.AioRpcError as exc:
            failure = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            failure = "the shared stream was closed"
        finally:
            self.closed = True
            self._outbox.put_nowait(None)
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"engine {self._address}: {failure}")
            for call in list(self._calls.values()):
                call.deliver(error)
            self._calls.clear()

    def close(self) -> None:
        """End the shared call (the engine aborts what still runs on it); its open requests fail UNAVAILABLE."""
        self.closed = True
        self._outbox.put_nowait(None)
        self._call.cancel()
