"""Traces from the client through the gateway into the engine.

Across real processes: the gateway and the engine export OTLP (configured by the standard OTEL_* variables
only) to a collector on loopback; a client's W3C traceparent is accepted and answered, the gateway's span is
its child, the engine's spans (the request and its queue, prefill and decode phases) are the gateway span's
descendants, in both engine-stream modes (request metadata in the shared stream, gRPC call metadata per call).
In one process, the same with the SDK's in-memory exporters on both sides of a real gRPC connection.
"""

import itertools
import secrets
import uuid

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer
from starlette.testclient import TestClient

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.server.tracing import GENERATE_SPAN, PHASE_SPANS, RequestSpans
from m3stack.gateway.api.app import create_app
from m3stack.gateway.api.config import GatewayConfig
from m3stack.tracing import REQUEST_ID_ATTRIBUTE, tracer_from_environment
from tests.engine.server.conftest import LOOPBACK, ServerThread
from tests.helpers.otlp_collector import CollectedSpan
from tests.helpers.serving import poll_until

pytestmark = pytest.mark.xdist_group("observability")


def client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def check_trace(spans: list[CollectedSpan], client_span_id: str, request_id: str, choices: int) -> None:
    """gateway span <- client's; engine.generate (one per choice) <- gateway span; phases <- engine.generate, in
    order; the request id on all."""
    (gateway,) = [span for span in spans if span.service == "m3stack-gateway"]
    assert gateway.parent_span_id == client_span_id and gateway.kind == SpanKind.SERVER.value + 1  # OTLP kinds: +1
    assert gateway.name == "POST /v1/chat/completions" and gateway.attributes["http.response.status_code"] == 200
    generates = [span for span in spans if span.name == GENERATE_SPAN]
    assert len(generates) == choices and all(span.service == "m3stack-engine" for span in generates)
    for generate in generates:
        assert generate.parent_span_id == gateway.span_id
        assert gateway.start_ns <= generate.start_ns and generate.end_ns <= gateway.end_ns + 5_000_000
        phases = sorted((s for s in spans if s.parent_span_id == generate.span_id), key=lambda s: s.start_ns)
        assert [s.name for s in phases] == list(PHASE_SPANS)
        assert phases[0].start_ns == generate.start_ns and phases[-1].end_ns == generate.end_ns
        assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(phases))
        assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert all(span.attributes[REQUEST_ID_ATTRIBUTE] == request_id for span in spans)


@pytest.mark.parametrize("which", ["gateway", "request_gateway"])
def test_a_client_trace_continues_through_the_gateway_into_the_engine(observed_stack, which):
    gateway = getattr(observed_stack, which)
    trace_id, client_span_id, traceparent = client_traceparent()
    request_id = f"traced-{uuid.uuid4().hex[:8]}"
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": observed_stack.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
              "n": 2, "ignore_eos": True},
        headers={"traceparent": traceparent, "x-request-id": request_id,
                 "Authorization": "Bearer sk-observability-test-key"},
        timeout=120,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    version, returned_trace, gateway_span_id, flags = response.headers["traceparent"].split("-")
    assert (version, returned_trace, flags) == ("00", trace_id, "01") and gateway_span_id != client_span_id
    spans = poll_until(
        lambda: (found := observed_stack.collector.spans(trace_id)) and len(found) >= 1 + 2 * 4 and found,
        15,
        "the gateway's and the engine's spans at the collector",
    )
    check_trace(spans, client_span_id, request_id, choices=2)
    assert next(s for s in spans if s.service == "m3stack-gateway").span_id == gateway_span_id


def test_without_a_traceparent_the_gateway_starts_the_trace(observed_stack):
    response = observed_stack.client().with_raw_response.chat.completions.create(
        model=observed_stack.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    _, trace_id, span_id, _ = response.headers["traceparent"].split("-")
    spans = poll_until(lambda: len(observed_stack.collector.spans(trace_id)) >= 5, 15, "the trace's spans")
    root = next(span for span in observed_stack.collector.spans(trace_id) if span.span_id == span_id)
    assert spans and root.parent_span_id == "" and root.service == "m3stack-gateway"


def test_in_memory_exporters_see_one_trace_across_gateway_and_engine(tiny_model_dir):
    """Both components in this process with the SDK's in-memory exporters, talking over real loopback gRPC."""
    engine_spans, gateway_spans = InMemorySpanExporter(), InMemorySpanExporter()

    def tracer(exporter: InMemorySpanExporter, service: str) -> Tracer:
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider.get_tracer("test")

    core = build_engine_core(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, max_num_batched_tokens=256, max_model_len=512)
    )
    server = ServerThread(core)
    server.metrics.on_finished.append(RequestSpans(tracer(engine_spans, "m3stack-engine")))
    try:
        config = GatewayConfig(
            model_dir=tiny_model_dir,
            served_model_name="tiny",
            engines=(f"{LOOPBACK}:{server.port}",),
            media_workers=0,
            access_log=False,
        )
        trace_id, client_span_id, traceparent = client_traceparent()
        with TestClient(create_app(config, tracer(gateway_spans, "m3stack-gateway"))) as http:
            poll_until(lambda: http.get("/ready").status_code == 200, 30, "the gateway to see the engine")
            response = http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                      "ignore_eos": True},
                headers={"traceparent": traceparent, "x-request-id": "in-memory-1"},
            )  # fmt: skip
        assert response.status_code == 200 and response.headers["traceparent"].split("-")[1] == trace_id
        server.wait_idle()
        spans = [
            CollectedSpan(
                service=str(span.resource.attributes["service.name"]),
                name=span.name,
                trace_id=f"{span.context.trace_id:032x}",
                span_id=f"{span.context.span_id:016x}",
                parent_span_id=f"{span.parent.span_id:016x}" if span.parent else "",
                kind=span.kind.value + 1,
                start_ns=span.start_time,
                end_ns=span.end_time,
                attributes=dict(span.attributes),
            )
            for span in (*gateway_spans.get_finished_spans(), *engine_spans.get_finished_spans())
        ]
        assert {span.trace_id for span in spans} == {trace_id}
        check_trace(spans, client_span_id, "in-memory-1", choices=1)
    finally:
        server.close()


def test_tracing_is_off_unless_the_otel_variables_ask_for_it():
    assert tracer_from_environment("m3stack-gateway", {}) is None
    assert tracer_from_environment("m3stack-gateway", {"OTEL_TRACES_EXPORTER": "none"}) is None
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    assert tracer_from_environment("m3stack-gateway", {**endpoint, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracer_from_environment("m3stack-gateway", endpoint) is not None
    assert tracer_from_environment("m3stack-engine", {"OTEL_TRACES_EXPORTER": "console"}) is not None
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'"):
        tracer_from_environment("m3stack-engine", {"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL: 'thrift'"):
        tracer_from_environment("m3stack-engine", {**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
