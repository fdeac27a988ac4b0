"""The HTTP side of a streamed completion: server-sent events, ended by ``data: [DONE]``.

The events are sent from a task of their own, as Starlette's ``StreamingResponse`` does: a task
that waits inside the route resumes through every middleware's frame each time it wakes, once per
token.  Starlette also runs an anyio task group per response (cancel scopes, and a ``repr`` of the
task whenever it cancels one); here a plain task waits for the client to go away and cancels the
stream, which closes the events (and so aborts the engine requests) wherever they wait.
"""

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from m3stack.gateway.api.render import SSE_DONE


class EventStreamResponse(StreamingResponse):
    """SSE events from ``events``; the event that ends with ``data: [DONE]`` is the last, and it goes out
    together with the end of the chunked body (one write instead of two)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(events, headers=headers)
        self._events = events
        self._ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        stream = loop.create_task(self._stream(send))
        watcher = loop.create_task(_wait_for_disconnect(receive))

        def on_disconnect(_: asyncio.Task[None]) -> None:
            # Completing the body also reads as a disconnect; only a client that left stops the stream.
            if not self._ended:
                stream.cancel()

        watcher.add_done_callback(on_disconnect)
        try:
            await stream
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request is being cancelled (awaiting the stream cancelled it too)
            # The client left: nothing more to send, and not an error.
        finally:
            watcher.cancel()

    async def _stream(self, send: Send) -> None:
        try:
            async for event in self._events:
                self._ended = event.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": event, "more_body": not self._ended})
            if not self._ended:
                self._ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._events.aclose()  # a no-op when the events ran out; else it closes the engine streams


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
