"""The HTTP side of a streamed completion: server-sent events, ended by ``data: [DONE]``.

Starlette's ``StreamingResponse`` runs every response in an anyio task group (a second task listening
for the disconnect, cancel scopes, and a ``repr`` of the task each time it cancels one); on this
gateway's hot path that came to about a tenth of a streamed request's CPU.  This response streams in
the request's own task, and one small task waits for the client to go away and cancels it, which
closes the event iterator (and so aborts the engine requests) wherever it waits.
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        task = asyncio.current_task()
        assert task is not None
        streaming = True
        disconnected = False

        def on_disconnect(watcher: asyncio.Future[None]) -> None:
            nonlocal disconnected
            if streaming and not watcher.cancelled():
                disconnected = True
                task.cancel()

        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        watcher.add_done_callback(on_disconnect)
        body_ended = False
        try:
            async for event in self._events:
                body_ended = event.endswith(SSE_DONE)
                if body_ended:
                    # Completing the body ends the disconnect watch (uvicorn then reports a disconnect).
                    streaming = False
                await send({"type": "http.response.body", "body": event, "more_body": not body_ended})
            if not body_ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            task.uncancel()  # the client left: nothing more to send, and not an error
        finally:
            streaming = False
            watcher.cancel()
            await self._events.aclose()  # a no-op when the events ran out; else it closes the engine streams


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
