"""OpenTelemetry tracing for the gateway and the engine: off unless the standard ``OTEL_*`` variables ask.

Tracing turns on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` is
off) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``),
and ``OTEL_SDK_DISABLED`` is not ``true``.  Everything else is the SDK's own reading of the standard
variables: the OTLP exporter's endpoint, headers, certificates and timeout, ``OTEL_EXPORTER_OTLP_PROTOCOL``
(``grpc``, the Python SDK's default, or ``http/protobuf``), ``OTEL_TRACES_SAMPLER`` and its argument, the
batch processor's ``OTEL_BSP_*``, and ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (the service
name defaults to ``m3stack-gateway`` / ``m3stack-engine``).

Context crosses processes as W3C trace context (``traceparent``, ``tracestate``): from the client's HTTP
headers into the gateway's span, from there in each engine request's metadata into the engine's spans.
Each component gets its ``Tracer`` (or None) explicitly: no global provider, so tests can run both in
one process with in-memory exporters.
"""

import os
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS = ("traceparent", "tracestate")
# The attribute naming a request's x-request-id on every span of it.
REQUEST_ID_ATTRIBUTE = "m3stack.request_id"
_PROPAGATOR = TraceContextTextMapPropagator()

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(name.strip().lower() not in ("", "none") for name in exporters.split(","))
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter(name: str, environ: Mapping[str, str]) -> "SpanExporter":
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console or none)")
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not grpc or http/protobuf")


def tracer_from_environment(service_name: str, environ: Mapping[str, str] = os.environ) -> trace.Tracer | None:
    """A tracer exporting as the ``OTEL_*`` variables say, or None when they do not ask for tracing.
    Raises ValueError naming the variable when one is wrong."""
    if not tracing_requested(environ):
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    names = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    exporters = [_exporter(name, environ) for name in names if name not in ("", "none")]
    # OTEL_SERVICE_NAME, when set, wins over our default name (Resource.create lets the argument win).
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))  # shut down (flushed) at exit
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("m3stack")


def extract(carrier: Mapping[str, str]) -> Context:
    """The remote parent a ``traceparent``/``tracestate`` carrier names (an empty context without one)."""
    return _PROPAGATOR.extract(carrier)


def inject(carrier: MutableMapping[str, str], context: Context | None = None) -> None:
    """Writes ``traceparent`` (and ``tracestate``) of the current span, or of ``context``'s."""
    _PROPAGATOR.inject(carrier, context)


def epoch_ns(monotonic_s: float, now_monotonic_s: float, now_epoch_ns: int) -> int:
    """A ``time.monotonic()`` instant as Unix-epoch nanoseconds (span timestamps), given one reading of both
    clocks taken together."""
    return now_epoch_ns - round((now_monotonic_s - monotonic_s) * 1e9)


def clocks() -> tuple[float, int]:
    """(monotonic seconds, epoch nanoseconds), read together."""
    return time.monotonic(), time.time_ns()
