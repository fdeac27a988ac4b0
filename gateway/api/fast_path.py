"""The completion routes without FastAPI's per-request machinery, for requests it would accept.

FastAPI takes each request through its router, dependency solving, two exit stacks and exception
wrappers: about 0.3 ms of the 4.8 ms of CPU a streamed request cost the gateway at 64 streams, all
of it before the engine sees the request, so in a burst each request's first token also waited for
that work on all the requests ahead of it.  This pure ASGI layer, just inside ``RequestGuard``, serves a
completion request whose body FastAPI would read as JSON and which is valid for the route's model:
the same model, the same service, the same error rendering.  Anything else (another route, another
content type, an invalid body) goes on to FastAPI, which answers it as before; the FastAPI routes stay
the definition of the API and of its OpenAPI document.
"""

import email.message
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from m3stack.gateway.api.errors import api_error_response, http_error_response
from m3stack.gateway.api.service import CompletionService
from m3stack.gateway.errors import APIError
from m3stack.gateway.schemas import ChatCompletionRequest, CompletionRequest

Handler = Callable[[Any, Request, float], Awaitable[Response]]


class CompletionFastPath:
    def __init__(self, app: ASGIApp, service: CompletionService) -> None:
        self._app = app
        self._routes: dict[str, tuple[type[BaseModel], Handler]] = {
            "/v1/chat/completions": (ChatCompletionRequest, service.chat),
            "/v1/completions": (CompletionRequest, service.completions),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not read_as_json(scope["headers"]):
            await self._app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except StarletteHTTPException as exc:  # RequestGuard's body size cap
            await http_error_response(exc)(scope, receive, send)
            return
        if body is None:
            return  # the client left before it sent the whole body
        model, handler = route
        try:
            request = model.model_validate_json(body)
        except ValidationError:
            request = None
        if request is None:  # FastAPI answers an invalid body (outside the except, so nothing chains to it)
            await self._app(scope, _replay(body, receive), send)
            return
        try:
            response = await handler(request, Request(scope, receive), scope["state"]["arrival_s"])
        except APIError as exc:
            response = api_error_response(exc)
        await response(scope, receive, send)


def read_as_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether FastAPI reads the body as JSON: a content type of application/json or ``+json`` (its
    strict default reads no body without one)."""
    value = next((value for name, value in headers if name == b"content-type"), None)
    return value is not None and _json_content_type(value)


@functools.lru_cache(maxsize=64)
def _json_content_type(value: bytes) -> bool:
    # FastAPI's own test, parser included (clients send the same few values: the cache keeps it cheap).
    message = email.message.Message()
    message["content-type"] = value.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app behind us: the body we read, then the connection's own messages."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
