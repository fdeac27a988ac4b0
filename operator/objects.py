"""Kubernetes objects as the operator's parts exchange them: plain JSON values and the API's timestamps.

Shared by the kopf wiring (``handlers.py``), the reconciler and the autoscaler daemon, which all turn kopf's
views into the plain dicts the pure render and status functions take, and stamp what they write.
"""

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """kopf's Body view as plain dicts and lists (what the render and status functions take)."""

    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: convert(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [convert(item) for item in value]
        return value

    return convert(body)


def utc_now() -> str:
    """Now, as the API server writes times (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
