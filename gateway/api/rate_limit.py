"""Per-API-key limits on the completion routes: requests per second, tokens per minute, concurrent requests.

Each key (its id: a hash, never the key; all clients share one key when the gateway runs without API keys) has
two token buckets and a count of requests in flight.  A request is admitted when its key's request bucket holds a
whole request, its token bucket is not in debt and fewer than the limit of its requests run; it is charged its
prompt and completion tokens when it ends (a request cannot know its completion's length before).  A refusal is a
429 with ``Retry-After``: the seconds until the bucket that refused has refilled.  Limits hold per gateway process:
N gateways behind a Service admit up to N times as much.
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from m3stack.gateway.api.access_log import AccessRecord
from m3stack.gateway.errors import APIError

ANONYMOUS_KEY = "-"  # the key of every request when the gateway has no API keys
# Keys seen but idle for this long are forgotten (their buckets are full again by then).
_IDLE_FORGET_S = 600.0


@dataclass(frozen=True)
class RateLimits:
    requests_per_second: float = 0.0  # 0: no limit; bursts of up to max(1, this) requests
    tokens_per_minute: int = 0  # 0: no limit; prompt + completion tokens
    concurrent_requests: int = 0  # 0: no limit

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_second or self.tokens_per_minute or self.concurrent_requests)


@dataclass
class _Bucket:
    capacity: float
    per_second: float
    level: float
    updated_s: float

    def refill(self, now_s: float) -> None:
        self.level = min(self.capacity, self.level + (now_s - self.updated_s) * self.per_second)
        self.updated_s = now_s

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / self.per_second)


@dataclass
class _KeyState:
    requests: _Bucket | None
    tokens: _Bucket | None
    in_flight: int = 0
    last_used_s: float = 0.0


@dataclass
class Admission:
    """One admitted request; ``finish`` (once) releases its slot and charges its tokens."""

    _limiter: "RateLimiter"
    _key: str
    _done: bool = field(default=False)

    def finish(self, tokens: int) -> None:
        if not self._done:
            self._done = True
            self._limiter.release(self._key, tokens)


class RateLimiter:
    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def admit(self, key: str) -> Admission:
        """Admit a request of ``key`` or raise a 429 with Retry-After."""
        limits = self.limits
        with self._lock:
            now = self._clock()
            state = self._state(key, now)
            if limits.concurrent_requests and state.in_flight >= limits.concurrent_requests:
                raise _too_many(
                    f"this API key already has {state.in_flight} requests running (the limit is "
                    f"{limits.concurrent_requests})",
                    1.0,
                )
            if state.requests is not None:
                state.requests.refill(now)
                if state.requests.level < 1:
                    raise _too_many(
                        f"this API key is over {limits.requests_per_second:g} requests per second",
                        state.requests.seconds_until(1),
                    )
            if state.tokens is not None:
                state.tokens.refill(now)
                if state.tokens.level <= 0:
                    raise _too_many(
                        f"this API key is over {limits.tokens_per_minute} tokens per minute",
                        state.tokens.seconds_until(1),
                    )
            if state.requests is not None:
                state.requests.level -= 1
            state.in_flight += 1
            state.last_used_s = now
        return Admission(self, key)

    def release(self, key: str, tokens: int) -> None:
        with self._lock:
            now = self._clock()
            state = self._keys[key]
            state.in_flight -= 1
            state.last_used_s = now
            if state.tokens is not None:
                state.tokens.refill(now)
                state.tokens.level -= tokens

    def _state(self, key: str, now: float) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            self._forget_idle(now)
            limits = self.limits
            requests = tokens = None
            if limits.requests_per_second:
                burst = max(1.0, limits.requests_per_second)
                requests = _Bucket(burst, limits.requests_per_second, burst, now)
            if limits.tokens_per_minute:
                tokens = _Bucket(limits.tokens_per_minute, limits.tokens_per_minute / 60, limits.tokens_per_minute, now)
            state = self._keys[key] = _KeyState(requests, tokens, last_used_s=now)
        return state

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, s in self._keys.items() if not s.in_flight and now - s.last_used_s > _IDLE_FORGET_S]
        for key in idle:
            del self._keys[key]


def charged_tokens(record: AccessRecord) -> int:
    """What a finished request costs its key: its prompt and completion tokens (0 when it never ran)."""
    if record.usage is None:
        return 0
    counts = record.usage()
    return counts.prompt_tokens + counts.completion_tokens


def _too_many(reason: str, retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(
        429,
        f"Rate limit reached: {reason}; retry in {seconds}s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )
