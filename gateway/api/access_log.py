"""Request identity and the access log: one JSON line per API request.

Every request gets an id: the client's ``x-request-id`` when it sends a valid one (a proxy in front
usually generates it), else a new one.  The id is returned in the response's ``x-request-id``
header, travels to the engines with the request, and is on every log line written while the request
is handled (``m3stack.logs.request_context``).

The access log line is written when the response has ended (for a stream, after its last event):
the request id, method, path, status, duration, the tokens the request consumed and produced, and
the id of the API key it used (a digest, never the key).  Log collectors read it as is.
"""

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from m3stack.gateway.errors import APIError
from m3stack.logs import utc_timestamp

REQUEST_ID_HEADER = b"x-request-id"
# Visible ASCII, as proxies generate them (UUIDs, Envoy's, AWS's Root=1-...); anything else would be
# unsafe in log lines and headers.
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
ACCESS_LOGGER = "m3stack.access"
ACCESS_STATE_KEY = "access"  # the ASGI scope["state"] key of the request's AccessRecord
CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client went away first": metrics and access lines only

logger = logging.getLogger(ACCESS_LOGGER)


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id``, or a new one when it sent none; a malformed one is a 400."""
    value = next((value for name, value in headers if name == REQUEST_ID_HEADER), None)
    if value is None:
        return new_request_id()
    if not _REQUEST_ID.fullmatch(value):
        raise APIError(
            400,
            "x-request-id must be 1 to 128 visible ASCII characters (no spaces)",
            param="x-request-id",
            code="invalid_request_id",
        )
    return value.decode("ascii")


class TokenCounts(Protocol):
    """What the access line reads from a request's usage (``generation.run.Usage``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class AccessRecord:
    """What one API request did; the service fills in what only it knows (model, stream, usage)."""

    request_id: str
    method: str
    path: str
    client: str | None
    started_s: float  # perf_counter at arrival
    api_key_id: str | None = None
    model: str | None = None
    stream: bool | None = None
    # The request's token counts, read when the line is written (a stream's are final only at its end).
    usage: Callable[[], TokenCounts] | None = None

    def line(self, status: int, now_s: float) -> str:
        counts = self.usage() if self.usage is not None else None
        entry = {
            "time": utc_timestamp(time.time()),
            "type": "access",
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": status,
            "duration_s": round(now_s - self.started_s, 6),
            "model": self.model,
            "stream": self.stream,
            "prompt_tokens": counts.prompt_tokens if counts else None,
            "completion_tokens": counts.completion_tokens if counts else None,
            "cached_tokens": counts.cached_tokens if counts else None,
            "api_key_id": self.api_key_id,
            "client": self.client,
        }
        return json.dumps(entry, ensure_ascii=False)


def access_record(scope: Mapping[str, Any]) -> AccessRecord | None:
    """The request's access record (None outside RequestGuard, e.g. when the service is driven directly)."""
    return scope.get("state", {}).get(ACCESS_STATE_KEY)


def enable_access_log() -> None:
    """Access lines go to stderr as bare JSON (their own handler, not the root's text format)."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def write_access_line(record: AccessRecord, status: int) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", record.line(status, time.perf_counter()))
