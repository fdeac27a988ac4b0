"""A running engine's /metrics against vLLM's list: every vllm:* name, type and label as vLLM exports it, the
metrics the issue asks for all there, and their values what the requests did."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.vllm_metrics_reference import BASE, FINISHED_REASONS, REQUIRED, VLLM_METRICS
from tests.helpers.serving import scrape, total

pytestmark = pytest.mark.xdist_group("observability")


def families(url: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names over its samples, histogram ``le`` left out)."""
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        labels = {name for sample in family.samples for name in sample.labels if name != "le"}
        found[family.name] = (family.type, labels)
    return found


def test_every_vllm_metric_has_vllms_name_type_and_labels(observed_stack):
    response = observed_stack.client().completions.create(
        model=observed_stack.model_name, prompt="warm up", max_tokens=2
    )  # so every labelled series exists
    assert response.usage.completion_tokens == 2
    exported = families(observed_stack.engine.url)
    ours = {name: value for name, value in exported.items() if name.startswith("vllm:")}
    for name, (kind, labels) in ours.items():
        assert name in VLLM_METRICS, f"{name} is not a vLLM metric"
        assert (kind, labels) == (VLLM_METRICS[name][0], set(VLLM_METRICS[name][1])), name
    assert set(REQUIRED) <= set(ours), sorted(set(REQUIRED) - set(ours))
    # What is m3stack's own stays under its prefix.
    assert all(name.startswith(("vllm:", "m3stack_engine_")) for name in exported), sorted(exported)
    samples = scrape(f"{observed_stack.engine.url}/metrics")
    model_names = {dict(labels).get("model_name") for name, labels in samples if name.startswith("vllm:")}
    assert model_names == {observed_stack.model_name}
    reasons = {dict(labels)["finished_reason"] for name, labels in samples if name == "vllm:request_success_total"}
    assert reasons == set(FINISHED_REASONS)
    assert set(BASE) == {"model_name", "engine"}


def test_the_values_follow_the_requests(observed_stack):
    url = f"{observed_stack.engine.url}/metrics"
    before = scrape(url)
    client = observed_stack.client()
    response = client.completions.create(
        model=observed_stack.model_name,
        prompt="The engine counts these tokens",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("vllm:request_prompt_tokens_sum") == response.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 6
    assert delta("vllm:request_params_max_tokens_sum") == 6
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert delta(f"{histogram}_count") == 1, histogram
    # The phases add up: inference = prefill + decode, and each is within the end-to-end time.
    phase = {name: delta(f"vllm:request_{name}_time_seconds_sum") for name in ("prefill", "decode", "inference")}
    assert phase["inference"] == pytest.approx(phase["prefill"] + phase["decode"], rel=1e-6, abs=1e-9)
    assert 0 < phase["inference"] <= delta("vllm:e2e_request_latency_seconds_sum")
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
    assert delta("vllm:prefix_cache_queries_total") == response.usage.prompt_tokens
    assert total(after, "vllm:num_requests_running") == 0 and total(after, "vllm:num_requests_waiting") == 0
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1
