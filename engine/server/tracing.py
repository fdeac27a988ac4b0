"""The engine's trace spans: one per request, with its queue, prefill and decode phases as children.

Spans are built when the request finishes (``EngineMetrics.on_finished``, on the engine thread) from
the timeline the metrics keep, so tracing adds nothing to a step while the request runs: a finished
span is only queued for the batch exporter.  The parent is the gateway's span, from the W3C trace
context the request carried (``traceparent`` in its metadata); the client's request id is on each span.
"""

from opentelemetry import trace

from m3stack.engine.server.metrics import FinishedRequest
from m3stack.tracing import REQUEST_ID_ATTRIBUTE, clocks, epoch_ns, extract

GENERATE_SPAN = "engine.generate"
PHASE_SPANS = ("engine.queue", "engine.prefill", "engine.decode")


class RequestSpans:
    """``on_finished`` listener writing a request's spans."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def __call__(self, finished: FinishedRequest) -> None:
        request = finished.request
        now_monotonic, now_ns = clocks()

        def at(monotonic_s: float) -> int:
            return epoch_ns(monotonic_s, now_monotonic, now_ns)

        attributes = {
            "m3stack.engine_request_id": request.request_id,
            "gen_ai.usage.input_tokens": finished.prompt_tokens,
            "gen_ai.usage.output_tokens": finished.generation_tokens,
            "m3stack.cached_tokens": finished.cached_tokens,
            "m3stack.finish_reason": finished.finish_reason,
        }
        client_request_id = request.metadata.get("x-request-id")
        if client_request_id:
            attributes[REQUEST_ID_ATTRIBUTE] = client_request_id
        root = self.tracer.start_span(
            GENERATE_SPAN,
            context=extract(request.metadata),
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
            start_time=at(request.arrival_time),
        )
        if finished.finish_reason == "error":
            root.set_status(trace.StatusCode.ERROR, "the request failed in the engine")
        # Phase boundaries: arrival, scheduled, first token, end (a phase that never began is left out).
        boundaries = [request.arrival_time, request.scheduled_time, finished.first_token_time, finished.end_time]
        parent = trace.set_span_in_context(root)
        phase_attributes = {REQUEST_ID_ATTRIBUTE: client_request_id} if client_request_id else {}
        for name, start, next_boundary in zip(PHASE_SPANS, boundaries, boundaries[1:], strict=False):
            if start is None:
                break
            end = finished.end_time if next_boundary is None else next_boundary
            span = self.tracer.start_span(name, context=parent, attributes=phase_attributes, start_time=at(start))
            span.end(end_time=at(end))
            if next_boundary is None:
                break
        root.end(end_time=at(finished.end_time))
