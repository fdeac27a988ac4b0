"""What follows one HTTP request through the gateway: its id, its trace span, its access-log record.

``RequestGuard`` (app.py) starts a ``TrackedRequest`` as the request arrives: the id (the client's
``x-request-id`` or a new one) goes into the logging context, the span (when tracing is on) becomes the
current span, a child of the client's ``traceparent`` when it sent one.  The response gets both back as
headers (``x-request-id``, and ``traceparent`` naming the gateway's span).  When the response has ended,
the span ends with its status and the access line is written.
"""

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from starlette.types import Message, Scope, Send

from m3stack.gateway.api.access_log import (
    ACCESS_STATE_KEY,
    CLIENT_CLOSED_REQUEST,
    REQUEST_ID_HEADER,
    AccessRecord,
    request_id_from,
    write_access_line,
)
from m3stack.tracing import REQUEST_ID_ATTRIBUTE, TRACE_HEADERS, extract, inject


class TrackedRequest:
    def __init__(self, scope: Scope, tracer: trace.Tracer | None, log_access: bool) -> None:
        headers = scope["headers"]
        self.request_id = request_id_from(headers)  # APIError (400) for a malformed one
        client = scope.get("client")
        self.record = AccessRecord(
            request_id=self.request_id,
            method=scope["method"],
            path=scope["path"],
            client=client[0] if client else None,
            started_s=scope["state"]["arrival_s"],
        )
        scope["state"][ACCESS_STATE_KEY] = self.record
        self.status: int | None = None
        self._log_access = log_access
        self._span: trace.Span | None = None
        if tracer is not None:
            carrier = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in headers
                if name.decode("latin-1") in TRACE_HEADERS
            }
            self._span = tracer.start_span(
                f"{scope['method']} {scope['path']}",
                context=extract(carrier),
                kind=trace.SpanKind.SERVER,
                attributes={
                    REQUEST_ID_ATTRIBUTE: self.request_id,
                    "http.request.method": scope["method"],
                    "url.path": scope["path"],
                    **({"client.address": client[0]} if client else {}),
                },
            )

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """The request's span is the current one inside (engine requests inherit it)."""
        if self._span is None:
            yield
            return
        with trace.use_span(self._span, end_on_exit=False):
            yield

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(REQUEST_ID_HEADER, self.request_id.encode("ascii"))]
        if self._span is not None:
            carrier: dict[str, str] = {}
            inject(carrier, trace.set_span_in_context(self._span))
            headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in carrier.items()]
        return headers

    def sender(self, send: Send) -> Send:
        """``send`` that records the status and adds the request's headers to the response."""

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *self.response_headers()]}
            await send(message)

        return tracked_send

    def finish(self, api_request: bool) -> None:
        """The response ended (or the client left): end the span and write the access line."""
        status = self.status if self.status is not None else CLIENT_CLOSED_REQUEST
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", status)
            if self.record.model is not None:
                self._span.set_attribute("gen_ai.request.model", self.record.model)
            if self.record.usage is not None:
                counts = self.record.usage()
                self._span.set_attribute("gen_ai.usage.input_tokens", counts.prompt_tokens)
                self._span.set_attribute("gen_ai.usage.output_tokens", counts.completion_tokens)
            if status >= 500:
                self._span.set_status(trace.StatusCode.ERROR)
            self._span.end()
        if api_request and self._log_access:
            write_access_line(self.record, status)
