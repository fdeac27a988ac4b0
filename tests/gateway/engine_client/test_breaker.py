"""The circuit breaker's state machine, on a clock the test moves."""

from m3stack.gateway.engine_client.breaker import BreakerSettings, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(BreakerSettings(failure_threshold=3, success_threshold=2, open_s=10.0), clock)


def test_opens_after_consecutive_failures_only():
    clock = Clock()
    b = breaker(clock)
    b.on_failure()
    b.on_failure()
    b.on_success()  # resets the run
    b.on_failure()
    b.on_failure()
    assert b.state is BreakerState.CLOSED and b.allows_request()
    b.on_failure()
    assert b.state is BreakerState.OPEN and not b.allows_request()
    assert b.seconds_until_retry() == 10.0


def test_half_open_lets_one_probe_through_and_closes_after_successes():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now += 9.9
    assert not b.allows_request()
    clock.now += 0.2
    assert b.state is BreakerState.HALF_OPEN and b.allows_request()
    b.on_request_start()
    assert not b.allows_request(), "a second probe while the first is in flight"
    b.on_success()
    assert b.state is BreakerState.HALF_OPEN and b.allows_request()
    b.on_request_start()
    b.on_success()
    assert b.state is BreakerState.CLOSED


def test_a_failed_probe_reopens_and_an_abandoned_one_frees_the_slot():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now += 10
    b.on_request_start()
    b.on_abandoned()
    assert b.allows_request()
    b.on_request_start()
    b.on_failure()
    assert b.state is BreakerState.OPEN
    assert b.seconds_until_retry() == 10.0
