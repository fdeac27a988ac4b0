"""A running gateway's /metrics: every series carries ``model_name``, the served model name the engine's vLLM
series carry too, so a dashboard's model selector or an inference-aware load balancer finds both tiers by it;
the built-in autoscaler reads the real page."""

import httpx
import pytest

from m3stack.metrics import GATEWAY_INFLIGHT, GATEWAY_REQUESTS, REFUSED_STATUS
from m3stack.operator.autoscaler.metrics_source import GatewayReading, parse_gateway_metrics
from tests.helpers.serving import Samples, StreamRunner, parse_samples, poll_until, scrape, total

pytestmark = pytest.mark.xdist_group("observability")


def test_every_gateway_series_carries_the_served_model_name(observed_stack):
    response = observed_stack.client().chat.completions.create(
        model=observed_stack.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert response.usage.completion_tokens >= 1
    samples = scrape(f"{observed_stack.gateway.url}/metrics")
    gateway = [(name, dict(labels)) for name, labels in samples if name.startswith("m3stack_gateway_")]
    names = {name for name, _ in gateway}
    assert {
        GATEWAY_REQUESTS,
        GATEWAY_INFLIGHT,
        "m3stack_gateway_engine_ready",
        "m3stack_gateway_time_to_first_token_seconds_bucket",
        "m3stack_gateway_prompt_tokens_total",
    } <= names, sorted(names)
    unlabelled = sorted(name for name, labels in gateway if labels.get("model_name") != observed_stack.model_name)
    assert not unlabelled, unlabelled
    engine = scrape(f"{observed_stack.engine.url}/metrics")
    assert {dict(labels)["model_name"] for name, labels in engine if name.startswith("vllm:")} == {
        observed_stack.model_name
    }
    assert total(samples, GATEWAY_REQUESTS, endpoint="/v1/chat/completions", model_name=observed_stack.model_name)


def test_the_autoscaler_reads_a_real_gateways_page(observed_stack):
    """While a stream is open, the reading is the page's in-flight total (>= 1) and its refused count."""
    stream = StreamRunner(observed_stack.client(), observed_stack.model_name, "Count:", max_tokens=200)
    stream.start()

    def reading_while_busy() -> tuple[GatewayReading, Samples] | None:
        page = httpx.get(f"{observed_stack.gateway.url}/metrics", timeout=10).text
        reading = parse_gateway_metrics(page)
        return (reading, parse_samples(page)) if reading.inflight >= 1 else None

    reading, samples = poll_until(reading_while_busy, 60, "a request in flight on the gateway", interval_s=0.02)
    stream.join(timeout=120)
    assert stream.error is None and stream.finish_reason == "length"
    assert reading == GatewayReading(
        inflight=total(samples, GATEWAY_INFLIGHT, model_name=observed_stack.model_name),
        refused=total(samples, GATEWAY_REQUESTS, status=REFUSED_STATUS, model_name=observed_stack.model_name),
    )
