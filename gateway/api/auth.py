"""Optional bearer-token auth: keys from a file (a mounted Secret), one per line.

Kubernetes updates a mounted Secret in place, so the file is re-read when its modification time
changes (checked at most once per ``recheck_s``): rotating a key needs no restart.
"""

import hashlib
import hmac
import logging
import time
from pathlib import Path

from m3stack.gateway.errors import APIError

logger = logging.getLogger(__name__)


def read_keys(path: Path) -> frozenset[str]:
    keys = frozenset(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if not keys:
        raise ValueError(f"{path}: no API keys in the file (one per line)")
    return keys


def key_id(key: str) -> str:
    """What logs name a key by: the first 16 hex digits of its SHA-256 (``printf %s KEY | sha256sum``), which
    tells keys apart without revealing them."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ApiKeys:
    def __init__(self, path: Path, recheck_s: float = 5.0) -> None:
        self._path = path
        self._recheck_s = recheck_s
        self._keys = read_keys(path)
        self._mtime = path.stat().st_mtime_ns
        self._checked_at = time.monotonic()

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self._recheck_s:
            return
        self._checked_at = now
        try:
            mtime = self._path.stat().st_mtime_ns
            if mtime != self._mtime:
                self._keys, self._mtime = read_keys(self._path), mtime
                logger.info("reloaded API keys from %s", self._path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("keeping the previous API keys: %s", exc)

    def check(self, authorization: str | None) -> str:
        """The id of the key (``key_id``) when the header is ``Bearer <one of the keys>``, else a 401."""
        self._refresh()
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        # Compare against every key so the time taken does not reveal which one nearly matched.
        matches = [hmac.compare_digest(token.encode(), key.encode()) for key in self._keys]
        if scheme.lower() != "bearer" or not token or not any(matches):
            raise APIError(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return key_id(token)
