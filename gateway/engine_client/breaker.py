"""A per-engine circuit breaker: stop sending requests to an engine that keeps failing.

closed --(failure_threshold failures in a row)--> open --(open_s elapsed)--> half-open
half-open lets one probe request through at a time: success_threshold successes close the breaker,
any failure opens it again.  Pure state machine; the clock is injected so tests control time.
"""

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.IntEnum):
    # Values are exported as a metric: 0 closed, 1 half-open, 2 open.
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True)
class BreakerSettings:
    failure_threshold: int = 5
    success_threshold: int = 2
    open_s: float = 10.0


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive, while closed
        self._successes = 0  # consecutive, while half-open
        self._opened_at = 0.0
        self._probes = 0  # requests in flight while half-open

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._settings.open_s:
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            self._probes = 0
        return self._state

    def allows_request(self) -> bool:
        """Whether a new request may go to this engine now (no side effect)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and self._probes == 0)

    def on_request_start(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._probes += 1

    def on_success(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)
            self._successes += 1
            if self._successes >= self._settings.success_threshold:
                self._state = BreakerState.CLOSED
                self._failures = 0
        elif state is BreakerState.CLOSED:
            self._failures = 0

    def on_failure(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open()
        elif state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self._settings.failure_threshold:
                self._open()

    def on_abandoned(self) -> None:
        """The request ended without telling success from failure (the client went away)."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)

    def seconds_until_retry(self) -> float:
        """How long until an open breaker lets a probe through (0 when it already does)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._settings.open_s - (self._clock() - self._opened_at))

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._successes = 0
        self._probes = 0
