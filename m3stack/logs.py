"""Logging setup shared by every m3stack process, and the request context of log lines.

A request's id (the ``x-request-id`` the gateway accepted or generated, and that travels to the
engine with the request) lives in a context variable while the request is handled; a filter on every
handler copies it onto each record, so any line logged on behalf of a request names it, whichever
module logs it.  ``--log-format json`` (``M3STACK_LOG_FORMAT``) writes one JSON object per line
instead of text, with the request id as its own field.
"""

import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_context)s: %(message)s"
LOG_FORMATS = ("text", "json")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("m3stack_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being handled in this context, if any."""
    return _request_id.get()


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Log lines inside the block (and in tasks started from it) carry ``request_id``."""
    token = _request_id.set(request_id or None)
    try:
        yield
    finally:
        _request_id.reset(token)


def set_request_id(request_id: str | None) -> None:
    """For a task that handles one request from its start to its end (its context dies with it)."""
    _request_id.set(request_id or None)


class RequestContextFilter(logging.Filter):
    """Puts the context's request id on each record: ``request_id`` (or None) and ``request_context``,
    the text format's `` [request <id>]`` suffix (empty outside a request).  A record that already has
    a ``request_id`` (``extra=``) keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or _request_id.get()
        record.request_id = request_id
        record.request_context = f" [request {request_id}]" if request_id else ""
        return True


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 with milliseconds, UTC (what log collectors parse without configuration)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id when there is one, the
    exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str | None = None, log_format: str | None = None) -> None:
    """Configure the root logger once; ``M3STACK_LOG_LEVEL`` overrides the default INFO and
    ``M3STACK_LOG_FORMAT`` (text or json) the default text."""
    chosen = (level or os.environ.get("M3STACK_LOG_LEVEL") or "INFO").upper()
    style = (log_format or os.environ.get("M3STACK_LOG_FORMAT") or "text").lower()
    if style not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {style!r}")
    root = logging.getLogger()
    if root.handlers:  # configured already (basicConfig's rule): leave it as it is
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if style == "json" else logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestContextFilter())
    root.addHandler(handler)
    root.setLevel(chosen)
