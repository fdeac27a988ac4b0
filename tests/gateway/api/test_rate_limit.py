"""Per-API-key limits with a controlled clock: each bucket refuses with the wait it needs, keys are independent."""

import pytest

from m3stack.gateway.api.rate_limit import RateLimiter, RateLimits
from m3stack.gateway.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(limiter: RateLimiter, key: str) -> APIError:
    with pytest.raises(APIError) as caught:
        limiter.admit(key)
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    return caught.value


def test_requests_per_second_with_a_burst_and_a_refill():
    clock = Clock()
    limiter = RateLimiter(RateLimits(requests_per_second=2), clock)
    for _ in range(2):
        limiter.admit("a").finish(0)
    error = refused(limiter, "a")
    assert error.headers["Retry-After"] == "1" and "2 requests per second" in error.message
    limiter.admit("b").finish(0)  # another key has its own bucket
    clock.now += 0.5  # one request's worth refilled
    limiter.admit("a").finish(0)
    refused(limiter, "a")


def test_tokens_per_minute_are_charged_when_a_request_ends():
    clock = Clock()
    limiter = RateLimiter(RateLimits(tokens_per_minute=600), clock)  # 10 tokens a second
    admission = limiter.admit("a")
    limiter.admit("a").finish(100)  # admitted while the first runs: nothing is charged before the end
    admission.finish(1000)  # 500 tokens in debt now
    error = refused(limiter, "a")
    assert error.headers["Retry-After"] == "51"  # (500 + 1) / 10, rounded up
    clock.now += 51
    limiter.admit("a").finish(0)


def test_concurrent_requests():
    limiter = RateLimiter(RateLimits(concurrent_requests=2), Clock())
    first, second = limiter.admit("a"), limiter.admit("a")
    assert "2 requests running" in refused(limiter, "a").message
    first.finish(0)
    first.finish(0)  # a second finish changes nothing
    third = limiter.admit("a")
    refused(limiter, "a")
    second.finish(0)
    third.finish(0)


def test_no_limits_is_off():
    assert not RateLimits().enabled and RateLimits(concurrent_requests=1).enabled
