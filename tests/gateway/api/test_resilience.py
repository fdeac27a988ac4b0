"""Two engines behind one gateway: traffic spreads, and when one is killed its streams end with an
error event (no hang), the others finish, and new requests move to the survivor; an engine that comes up
after the gateway gets traffic within seconds, whatever ``--health-interval`` says."""

import logging
import time

import pytest

from tests.helpers.serving import StreamRunner, series, total

pytestmark = pytest.mark.xdist_group("gateway_api")

logger = logging.getLogger(__name__)

PROMPT = "Tell me a long story about engines and gateways."  # 31 tokens
# The streams must still run when the test has seen them on both engines and kills one: on a fast machine 8 streams
# of 96 tokens ended in 0.7 s, before a /metrics scrape of the gateway busy streaming them came back (one CI run
# never saw both engines busy). 12 streams of 200 tokens (31 + 200 within the tiny model's 256) run several times
# longer.
STREAMS = 12
STREAM_TOKENS = 200
# From an engine's /loaded to the gateway routing to it: a few probe periods of a busy 2-core machine, far
# below the 600 s health interval of these gateways (users set 30-60 s to keep probe load low).
ROUTED_WITHIN_S = 15.0


def routes_to(gateway, engine, model_name) -> bool:
    samples = gateway.metrics()
    return series(samples, "m3stack_gateway_engine_ready", engine=engine.address, model_name=model_name) == 1


@pytest.fixture(scope="module")
def pair(stack, engine, model_name, wait_until):
    first, second = stack.engine(), engine  # the first is killed; the session's engine survives
    # No health probes after the start: the gateway learns about the killed engine from failing calls,
    # and its breaker opens after 8 of them (more than the streams killed with it, so that new requests
    # still try it and get retried elsewhere first).
    gateway = stack.gateway(
        [first, second], "--media-workers", "0", "--health-interval", "600", "--breaker-failures", "8"
    )

    # The gateway is ready with one engine ready; the tests start from both (one slow to answer its first probe
    # on a busy machine is probed again within a second).
    wait_until(
        lambda: routes_to(gateway, first, model_name) and routes_to(gateway, second, model_name),
        ROUTED_WITHIN_S,
        "the gateway to find both engines ready",
    )
    return first, second, gateway


def prompt_tokens(engine) -> float:
    return total(engine.metrics(), "vllm:prompt_tokens_total")


def test_prefix_aware_routing_keeps_a_shared_prefix_on_one_engine(stack, pair, model_name):
    first, second, _ = pair
    gateway = stack.gateway([first, second], "--media-workers", "0", "--routing", "prefix-aware")
    client = gateway.client()
    system = "You are a careful assistant who answers in one short sentence. " * 4
    before = {e.address: prompt_tokens(e) for e in (first, second)}
    for question in ("What is a KV cache?", "What is MSA?", "Why batch requests?", "What is a gateway?"):
        client.chat.completions.create(
            model=model_name,
            max_tokens=1,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
    grew = [e.address for e in (first, second) if prompt_tokens(e) > before[e.address]]
    assert len(grew) == 1, "one engine got every request sharing the prefix"


def inflight(gateway, *engines) -> list[float]:
    """Each engine's requests in flight, from one scrape (a moment of the gateway, not several)."""
    samples = gateway.metrics()
    return [total(samples, "m3stack_gateway_engine_inflight_requests", engine=engine.address) for engine in engines]


def test_traffic_spreads_then_survives_a_killed_engine(pair, model_name, wait_until):
    first, second, gateway = pair
    client = gateway.client(timeout_s=120)
    runners = [StreamRunner(client, model_name, PROMPT, max_tokens=STREAM_TOKENS) for _ in range(STREAMS)]
    for runner in runners:
        runner.start()
    wait_until(lambda: min(inflight(gateway, first, second)) >= 1, 60, "streams on both engines")
    wait_until(lambda: sum(r.chunks for r in runners) >= STREAMS, 60, "tokens flowing")
    (on_first,) = inflight(gateway, first)

    first.kill()
    for runner in runners:
        runner.join(timeout=120)
        assert not runner.is_alive(), "a stream hung after its engine died"
    failed = [r for r in runners if r.error is not None]
    finished = [r for r in runners if r.error is None]
    assert len(failed) == on_first, "exactly the streams on the killed engine fail"
    assert all("failed" in str(r.error) or "lost" in str(r.error) for r in failed), [str(r.error) for r in failed]
    assert finished and all(r.finish_reason == "length" for r in finished)

    # New requests land on the survivor: those that try the dead engine first are retried before any
    # token, until its breaker opens and it is skipped.
    def breaker_state() -> float:
        return series(
            gateway.metrics(), "m3stack_gateway_engine_breaker_state", engine=first.address, model_name=model_name
        )

    for _ in range(20):
        response = client.completions.create(
            model=model_name, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert response.usage.completion_tokens == 3
        if breaker_state() == 2:
            break
    metrics = gateway.metrics()
    assert breaker_state() == 2, "the breaker of the dead engine is open"
    assert series(metrics, "m3stack_gateway_engine_retries_total", model_name=model_name) >= 1
    assert series(metrics, "m3stack_gateway_engine_inflight_requests", engine=first.address, model_name=model_name) == 0


def test_an_engine_that_comes_up_after_the_gateway_gets_traffic_within_seconds(stack, engine, model_name, wait_until):
    late = stack.engine()
    late.kill()  # nothing answers at its address when the gateway starts
    gateway = stack.gateway([engine, late], "--media-workers", "0", "--health-interval", "600")
    try:
        assert not routes_to(gateway, late, model_name)
        late.child = stack.processes.restart(late.child)  # the same command, so the same port
        stack.processes.wait_http_ok(late.child, late.metrics_url.replace("/metrics", "/loaded"), 300)
        loaded_at = time.monotonic()
        wait_until(lambda: routes_to(gateway, late, model_name), ROUTED_WITHIN_S, "the gateway to route to it")
        logger.info("the gateway routes to the late engine %.1f s after it loaded", time.monotonic() - loaded_at)
    finally:
        stack.processes.stop([gateway.child, late.child])
