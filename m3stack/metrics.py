"""Prometheus definitions shared across components: the request-latency histograms of the engine and the gateway,
and the names of the gateway series the operator's autoscalers read.

Both measure time to first token, inter-token latency and end-to-end latency, the engine under
vLLM's names (``vllm:time_to_first_token_seconds``...), the gateway under its own
(``m3stack_gateway_...``, from the client's side of the gateway).  Their buckets hold every
boundary of vLLM's (so dashboards and alerts written for vLLM that name a bucket, ``le="0.1"``, find
it), plus finer ones below where an H200 decodes (a token every few milliseconds).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram

# The label of every engine (vLLM's name for it) and gateway series: the served model name.
MODEL_NAME_LABEL = "model_name"
# The gateway series every engine autoscaler reads (the built-in one scrapes the gateways' /metrics; KEDA and HPA
# query them through Prometheus): the gateway defines them under these names (gateway/metrics.py).
# Engine requests one gateway has open on each engine right now (gauge, labels ``model_name``, ``engine``).
GATEWAY_INFLIGHT = "m3stack_gateway_engine_inflight_requests"
# HTTP API requests by endpoint and status (counter, labels ``model_name``, ``endpoint``, ``status``).
GATEWAY_REQUESTS = "m3stack_gateway_requests_total"
# The status of a request no engine could take: demand while a deployment has no ready engine.
REFUSED_STATUS = "503"

# vLLM's time-to-first-token buckets (vllm/v1/metrics/loggers.py) plus 2.5 ms.
TTFT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's inter-token buckets start at 10 ms; 1 to 7.5 ms below them.
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's request-latency buckets (end to end, queue, prefill, decode, inference) from 300 ms; 10 to 200 ms below.
REQUEST_LATENCY_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Observer(Protocol):
    """What a histogram or one of its labelled children offers."""

    def observe(self, amount: float) -> None: ...


@dataclass(frozen=True)
class LatencyHistograms:
    time_to_first_token: Observer
    inter_token_latency: Observer
    e2e_request_latency: Observer


def latency_histograms(
    prefix: str, registry: CollectorRegistry, labels: Mapping[str, str] | None = None
) -> LatencyHistograms:
    """``<prefix>time_to_first_token_seconds``, ``<prefix>inter_token_latency_seconds`` and
    ``<prefix>e2e_request_latency_seconds`` in ``registry``, bound to ``labels`` when given."""
    labels = dict(labels or {})

    def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Observer:
        metric = Histogram(f"{prefix}{name}", text, list(labels), buckets=buckets, registry=registry)
        return metric.labels(**labels) if labels else metric

    return LatencyHistograms(
        time_to_first_token=histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        ),
        inter_token_latency=histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        ),
        e2e_request_latency=histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS_S
        ),
    )
