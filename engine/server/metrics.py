"""Prometheus metrics of one engine, fed from the engine thread (``StepObserver``).

Names follow Prometheus conventions with an ``m3stack_engine_`` prefix; counters that mirror the
core's cumulative statistics advance by the difference since the previous step.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from m3stack.engine.offload.metrics import OffloadStats
from m3stack.engine.runtime.engine_core import EngineStats, StepReport
from m3stack.engine.runtime.request import Request, RequestOutput
from m3stack.engine.server.async_engine import HEALTH_REQUEST_PREFIX, StepObserver

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class EngineMetrics(StepObserver):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge("m3stack_engine_requests_running", "Requests admitted and running", registry=r)
        self.waiting = Gauge("m3stack_engine_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_usage = Gauge(
            "m3stack_engine_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests", ["tier"], registry=r
        )
        self.draining = Gauge("m3stack_engine_draining", "1 while the engine drains before shutdown", registry=r)
        self.prefix_queries = Counter(
            "m3stack_engine_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "m3stack_engine_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.preemptions = Counter("m3stack_engine_preemptions", "Requests preempted by recompute", registry=r)
        self.encoder_hits = Counter(
            "m3stack_engine_encoder_cache_hits", "Images/videos served from the encoder cache", registry=r
        )
        self.encoder_misses = Counter(
            "m3stack_engine_encoder_cache_misses", "Images/videos run through the vision tower", registry=r
        )
        self.prompt_tokens = Counter("m3stack_engine_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("m3stack_engine_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "m3stack_engine_requests_finished", "Finished requests by finish reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "m3stack_engine_time_to_first_token_seconds",
            "From arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "m3stack_engine_inter_token_latency_seconds",
            "Between consecutive outputs of a request, per token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "m3stack_engine_e2e_request_latency_seconds", "From arrival to the end", buckets=_E2E_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            "m3stack_engine_step_duration_seconds",
            "One engine step (schedule, forward, sample, update)",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_usage.labels(tier="device").set(0)
        self.offload = OffloadMetrics(r)
        self._arrival: dict[str, float] = {}
        self._last_output: dict[str, float] = {}
        self._previous = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)

    def on_request_added(self, request: Request) -> None:
        if not request.request_id.startswith(HEALTH_REQUEST_PREFIX):
            self._arrival[request.request_id] = request.arrival_time

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            arrival = self._arrival.get(output.request_id)
            if arrival is None:
                continue
            if output.new_token_ids:
                self.generation_tokens.inc(len(output.new_token_ids))
                last = self._last_output.get(output.request_id)
                if last is None:
                    self.ttft.observe(now - arrival)
                else:
                    self.itl.observe((now - last) / len(output.new_token_ids))
                self._last_output[output.request_id] = now
            if output.finished or output.error is not None:
                reason = "error" if output.error is not None else output.finish_reason.value
                self.finished.labels(reason=reason).inc()
                self.prompt_tokens.inc(output.num_prompt_tokens)
                self.e2e.observe(now - arrival)
                self._arrival.pop(output.request_id, None)
                self._last_output.pop(output.request_id, None)

    def on_step(self, report: StepReport) -> None:
        if report.num_requests:
            self.step_seconds.labels(kind="decode" if report.is_pure_decode else "mixed").observe(report.seconds)

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.labels(tier="device").set(stats.kv_usage)
        previous = self._previous
        self.prefix_queries.inc(stats.prefix_query_tokens - previous.prefix_query_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens - previous.prefix_hit_tokens)
        self.preemptions.inc(stats.num_preemptions - previous.num_preemptions)
        self.encoder_hits.inc(stats.encoder_cache_hits - previous.encoder_cache_hits)
        self.encoder_misses.inc(stats.encoder_cache_misses - previous.encoder_cache_misses)
        if stats.offload is not None:
            self.kv_usage.labels(tier="host").set(stats.offload.host_blocks_used / stats.offload.host_blocks)
            self.offload.update(stats.offload)
        self._previous = stats


class OffloadMetrics:
    """CPU KV offload (``engine.offload.metrics.OffloadStats``): counters advance by the difference since the
    previous statistics; rates (hit rate, churn, GB/s) are left to PromQL over these counters."""

    _COUNTERS = (
        ("spilled_blocks", "offload_spilled_blocks", "KV blocks moved from the GPU to pinned host memory"),
        ("spill_bytes", "offload_device_to_host_bytes", "Bytes of KV moved to host memory"),
        ("hot_hits", "offload_hot_buffer_hits", "Selected host blocks a decode step found in its hot buffer"),
        ("hot_misses", "offload_hot_buffer_misses", "Selected host blocks a decode step copied to the GPU"),
        ("miss_bytes", "offload_miss_host_to_device_bytes", "Bytes decode steps copied host -> device"),
        ("staged_bytes", "offload_prefill_host_to_device_bytes", "Bytes prefill chunks read from host blocks"),
        ("selected_blocks", "offload_selected_blocks", "Distinct blocks decode steps selected (churn base)"),
        ("churned_blocks", "offload_churned_blocks", "Selected blocks the previous step did not select"),
        ("miss_copy_seconds", "offload_miss_copy_seconds", "GPU time of timed decode miss copies (the stall)"),
        ("timed_miss_bytes", "offload_timed_miss_bytes", "Bytes of the timed decode miss copies"),
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters = {
            field: Counter(f"m3stack_engine_{name}", text, registry=registry) for field, name, text in self._COUNTERS
        }
        self.hot_buffers = Gauge(
            "m3stack_engine_offload_hot_buffers", "Requests holding a GPU hot buffer for host blocks", registry=registry
        )
        self._previous: OffloadStats | None = None

    def update(self, stats: OffloadStats) -> None:
        self.hot_buffers.set(stats.hot_buffers)
        for field, counter in self._counters.items():
            before = getattr(self._previous, field) if self._previous is not None else 0
            counter.inc(max(0, getattr(stats, field) - before))
        self._previous = stats
