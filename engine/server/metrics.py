"""Prometheus metrics of one engine, fed from the engine thread (``StepObserver``).

The model-server metrics carry vLLM's names, types, units and labels (``model_name`` and ``engine``;
reference: vLLM's ``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``), so the Grafana
dashboards, KEDA/HPA examples and the Gateway API inference extension's endpoint picker written
for vLLM read an m3stack engine as they are.  The intervals follow vLLM's definitions
(``docs/design/metrics.md``): queue = arrival to the most recent scheduling, prefill = that to the
first token, decode = first to last token, inference = prefill + decode.  What only m3stack has
(CPU KV offload, MSA's selected blocks and index scan times, step times, draining) stays under
``m3stack_engine_``.

Counters that mirror the core's cumulative statistics advance by the difference since the previous
step.  Finished requests are also handed to ``on_finished`` listeners (trace spans).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from m3stack.engine.msa.metrics import PHASES, MsaStats
from m3stack.engine.offload.metrics import OffloadStats
from m3stack.engine.runtime.engine_core import EngineStats, StepReport
from m3stack.engine.runtime.request import Request, RequestOutput
from m3stack.engine.server.async_engine import HEALTH_REQUEST_PREFIX, StepObserver
from m3stack.metrics import ITL_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S, latency_histograms

VLLM_PREFIX = "vllm:"
# vLLM labels every metric with the served model and the engine's index among data-parallel engines; an
# m3stack engine process is one engine.
ENGINE_INDEX = "0"
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
# vLLM's buckets for tokens per engine step.
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class FinishedRequest:
    """One finished request's timeline (monotonic seconds) and counts, for metrics and trace spans."""

    request: Request
    first_token_time: float | None  # None when it ended before producing a token
    end_time: float
    finish_reason: str  # stop, length, abort or error
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int


@dataclass(slots=True)
class _Tracked:
    request: Request
    first_token_time: float | None = None
    last_token_time: float | None = None
    generated: int = 0


class EngineMetrics(StepObserver):
    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        names = list(labels)

        def vllm(kind: type, name: str, text: str, **kwargs: object) -> Any:  # a labelled child of any kind
            return kind(f"{VLLM_PREFIX}{name}", text, names, registry=r, **kwargs).labels(**labels)

        self.running = vllm(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = vllm(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = vllm(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = vllm(
            Counter, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = vllm(Counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.mm_queries = vllm(
            Counter, "mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."
        )
        self.mm_hits = vllm(Counter, "mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = vllm(Counter, "num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = vllm(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = vllm(
            Counter, "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = vllm(Counter, "generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            f"{VLLM_PREFIX}request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._success_by_reason = {
            reason: self._success.labels(**labels, finished_reason=reason)
            for reason in ("stop", "length", "abort", "error")
        }
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = vllm(
            Histogram, "request_prompt_tokens", "Number of prefill tokens processed.", buckets=token_buckets
        )
        self.request_generation_tokens = vllm(
            Histogram, "request_generation_tokens", "Number of generation tokens processed.", buckets=token_buckets
        )
        self.request_max_tokens = vllm(
            Histogram,
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets=token_buckets,
        )
        self.request_prefill_kv_computed = vllm(
            Histogram,
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets=token_buckets,
        )
        self.iteration_tokens = vllm(
            Histogram,
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=_ITERATION_TOKEN_BUCKETS,
        )
        self.latency = latency_histograms(VLLM_PREFIX, r, labels)
        self.time_per_output_token = vllm(
            Histogram,
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=ITL_BUCKETS_S,
        )
        phases = {
            "queue": "Histogram of time spent in WAITING phase for request.",
            "inference": "Histogram of time spent in RUNNING phase for request.",
            "prefill": "Histogram of time spent in PREFILL phase for request.",
            "decode": "Histogram of time spent in DECODE phase for request.",
        }
        self.phase_seconds = {
            phase: vllm(Histogram, f"request_{phase}_time_seconds", text, buckets=REQUEST_LATENCY_BUCKETS_S)
            for phase, text in phases.items()
        }
        # Ours.
        self.draining = Gauge("m3stack_engine_draining", "1 while the engine drains before shutdown", registry=r)
        self.step_seconds = Histogram(
            "m3stack_engine_step_duration_seconds",
            "One engine step (schedule, forward, sample, update)",
            ["kind"],
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.offload = OffloadMetrics(r)
        self.msa = MsaMetrics(r)
        self.on_finished: list[Callable[[FinishedRequest], None]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._previous = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)

    # --- engine thread events --------------------------------------------------------------------

    def on_request_added(self, request: Request) -> None:
        if not request.request_id.startswith(HEALTH_REQUEST_PREFIX):
            self._tracked[request.request_id] = _Tracked(request)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.new_token_ids:
                self._on_tokens(tracked, output, now)
            if output.finished or output.error is not None:
                del self._tracked[output.request_id]
                self._on_finished(tracked, output, now)

    def _on_tokens(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        count = len(output.new_token_ids)
        self.generation_tokens.inc(count)
        tracked.generated += count
        if tracked.first_token_time is None:
            tracked.first_token_time = now
            self.latency.time_to_first_token.observe(now - tracked.request.arrival_time)
            self.prompt_tokens.inc(output.num_prompt_tokens)
            self.prompt_tokens_cached.inc(output.num_cached_tokens)
        else:
            self.latency.inter_token_latency.observe((now - tracked.last_token_time) / count)
        tracked.last_token_time = now

    def _on_finished(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        request = tracked.request
        reason = "error" if output.error is not None else output.finish_reason.value
        finished = FinishedRequest(
            request=request,
            first_token_time=tracked.first_token_time,
            end_time=now,
            finish_reason=reason,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens or 0,
            generation_tokens=tracked.generated,
        )
        self._success_by_reason[reason].inc()
        self.latency.e2e_request_latency.observe(now - request.arrival_time)
        self.request_prompt_tokens.observe(finished.prompt_tokens)
        self.request_generation_tokens.observe(finished.generation_tokens)
        self.request_prefill_kv_computed.observe(finished.prompt_tokens - finished.cached_tokens)
        if request.sampling.max_new_tokens is not None:
            self.request_max_tokens.observe(request.sampling.max_new_tokens)
        scheduled = request.scheduled_time
        if scheduled is not None:
            # vLLM's intervals: a request that never produced a token spent its running time in prefill.
            first = tracked.first_token_time or now
            last = tracked.last_token_time or now
            self.phase_seconds["queue"].observe(scheduled - request.arrival_time)
            self.phase_seconds["prefill"].observe(first - scheduled)
            self.phase_seconds["decode"].observe(last - first)
            self.phase_seconds["inference"].observe(last - scheduled)
            if tracked.generated > 1:
                self.time_per_output_token.observe((last - first) / (tracked.generated - 1))
        for listener in self.on_finished:
            listener(finished)

    def on_step(self, report: StepReport) -> None:
        if report.num_requests:
            self.step_seconds.labels(kind="decode" if report.is_pure_decode else "mixed").observe(report.seconds)
            self.iteration_tokens.observe(report.num_tokens)

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        previous = self._previous
        self.prefix_queries.inc(stats.prefix_query_tokens - previous.prefix_query_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens - previous.prefix_hit_tokens)
        self.preemptions.inc(stats.num_preemptions - previous.num_preemptions)
        hits = stats.encoder_cache_hits - previous.encoder_cache_hits
        self.mm_hits.inc(hits)
        self.mm_queries.inc(hits + stats.encoder_cache_misses - previous.encoder_cache_misses)
        if stats.offload is not None:
            self.offload.update(stats.offload)
        if stats.msa is not None:
            self.msa.update(stats.msa)
        self._previous = stats


class CounterDeltas:
    """Prometheus counters that follow cumulative fields of a statistics dataclass: each ``update`` adds what a field
    gained since the previous one (never a negative step, which a counter cannot take)."""

    def __init__(self, counters: dict[str, Any]) -> None:  # field name -> a counter or a labelled child
        self._counters = counters
        self._previous: dict[str, float] = dict.fromkeys(counters, 0)

    def update(self, stats: object) -> None:
        for field, counter in self._counters.items():
            value = getattr(stats, field)
            counter.inc(max(0, value - self._previous[field]))
            self._previous[field] = value


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
        ("selected_blocks", "offload_selected_blocks", "Distinct blocks MSA decode steps selected (churn base)"),
        ("churned_blocks", "offload_churned_blocks", "Selected blocks the previous step did not select"),
        ("miss_copy_seconds", "offload_miss_copy_seconds", "GPU time of timed decode miss copies (the stall)"),
        ("timed_miss_bytes", "offload_timed_miss_bytes", "Bytes of the timed decode miss copies"),
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters = CounterDeltas(
            {field: Counter(f"m3stack_engine_{name}", text, registry=registry) for field, name, text in self._COUNTERS}
        )
        self.hot_buffers = Gauge(
            "m3stack_engine_offload_hot_buffers", "Requests holding a GPU hot buffer for host blocks", registry=registry
        )
        self.host_usage = Gauge(
            "m3stack_engine_offload_host_kv_cache_usage_perc",
            "Fraction of the pinned host KV pool's blocks in use (1 = full)",
            registry=registry,
        )

    def update(self, stats: OffloadStats) -> None:
        self.hot_buffers.set(stats.hot_buffers)
        self.host_usage.set(stats.host_blocks_used / stats.host_blocks if stats.host_blocks else 0.0)
        self._counters.update(stats)


class MsaMetrics:
    """MSA's own counters (``engine.msa.metrics.MsaStats``), by ``phase`` (prefill, decode).  PromQL derives the
    fraction of visible blocks attended (selected / candidate) and the mean scan time (seconds / scans, or per
    token and layer: seconds / tokens).  They stay at zero on an engine without MSA layers (``--attention dense``)."""

    _COUNTERS = (
        ("selected_blocks", "msa_selected_blocks",
         "KV blocks MSA layers selected, summed over query tokens and MSA layers (each index head selects as many)"),
        ("candidate_blocks", "msa_candidate_blocks",
         "KV blocks those query tokens could see in MSA layers (what dense attention reads)"),
        ("index_scan_seconds", "msa_index_scan_seconds",
         "Time of the timed MSA index scans (scores and block top-k; GPU time of sampled eager steps on CUDA)"),
        ("timed_index_scans", "msa_timed_index_scans", "MSA index scans timed (GPU: one MSA layer of one step)"),
        ("timed_index_scan_tokens", "msa_timed_index_scan_tokens", "Query tokens the timed MSA index scans scored"),
    )  # fmt: skip

    def __init__(self, registry: CollectorRegistry) -> None:
        families = {
            field: Counter(f"m3stack_engine_{name}", text, ["phase"], registry=registry)
            for field, name, text in self._COUNTERS
        }
        self._phases = {
            phase: CounterDeltas({field: family.labels(phase=phase) for field, family in families.items()})
            for phase in PHASES
        }

    def update(self, stats: MsaStats) -> None:
        for phase, counters in self._phases.items():
            counters.update(getattr(stats, phase))
