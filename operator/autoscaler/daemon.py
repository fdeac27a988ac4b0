"""The built-in autoscaler daemon: one asyncio task per M3Deployment, fed by the operator's watch events.

- Mode ``Builtin`` (not suspended): every tick it reads the gateways' in-flight counts, feeds
  ``algorithm``, writes a changed engine count through the M3Deployment's ``/scale`` subresource,
  applies ``status.autoscaling`` and the ``AutoscalingActive`` condition (server-side apply with its
  own field manager, so the reconciler's status writes and these never overwrite each other) and
  posts Events when the count or the situation changes.
- Modes ``KEDA`` and ``HPA``: the rendered ScaledObject / HorizontalPodAutoscaler drives ``/scale``;
  the daemon only records the mode in status.
- Mode ``None``: it removes what it wrote (``status.py`` then reports AutoscalingActive=Disabled).

kopf's daemons are not used: they put a finalizer on every resource (deletion would hang while the
operator is down), the reason the drift loop in ``runner.py`` is one task too.
"""

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from m3stack.operator.apply import M3DEPLOYMENT, ApiError, Cluster
from m3stack.operator.autoscaler import report
from m3stack.operator.autoscaler.algorithm import (
    AutoscalerConfig,
    AutoscalerState,
    ClusterState,
    Decision,
    Reason,
    decide,
    initial_state,
    observe,
)
from m3stack.operator.autoscaler.cluster_view import ClusterView, Key, engine_cluster_state
from m3stack.operator.autoscaler.metrics_source import GatewayScraper, MetricsTargets, Scrape
from m3stack.operator.crd import API_VERSION, PLURAL
from m3stack.operator.metrics import OperatorMetrics
from m3stack.operator.objects import plain, utc_now
from m3stack.operator.render.names import ENGINE, GATEWAY, MANAGED_BY_LABEL, OPERATOR_NAME
from m3stack.operator.spec import EngineAutoscaling, M3Deployment

logger = logging.getLogger(__name__)

FIELD_MANAGER = "m3stack-autoscaler"
# Changes of the observed concurrency alone reach the status at most this often (decisions at once).
STATUS_REFRESH_S = 10.0
_VOLATILE_KEYS = ("observedConcurrency", "panicConcurrency")


@dataclass(frozen=True)
class AutoscalerOptions:
    interval_s: float = 2.0  # one scrape and decision per Builtin resource per interval
    scrape_timeout_s: float = 1.0
    targets: MetricsTargets = field(default_factory=MetricsTargets)


def autoscaler_config(scaling: EngineAutoscaling) -> AutoscalerConfig:
    """The algorithm's settings from spec.autoscaling.engine; raises ValueError on a combination the
    CRD's own checks let through."""
    return AutoscalerConfig(
        target_per_engine=scaling.target_concurrency,
        utilization=scaling.target_utilization,
        min_replicas=scaling.min_replicas,
        max_replicas=scaling.max_replicas,
        stable_window_s=scaling.stable_window_seconds,
        panic_window_s=scaling.panic_window_seconds,
        panic_threshold=scaling.panic_threshold,
        max_scale_up_rate=scaling.max_scale_up_rate,
        max_scale_down_rate=scaling.max_scale_down_rate,
        scale_down_delay_s=scaling.scale_down_delay_seconds,
    )


def refused_since(previous: dict[str, float], scrape: Scrape) -> float:
    """503s counted by the gateways since the previous scrape (updates ``previous``).  A gateway seen for
    the first time sets its baseline; a counter that went down (restarted gateway) counts from zero."""
    total = 0.0
    for url, reading in scrape.readings.items():
        before = previous.get(url)
        if before is not None:
            total += reading.refused - before if reading.refused >= before else reading.refused
        previous[url] = reading.refused
    return total


def owns_status_fields(body: Mapping[str, Any], manager: str = FIELD_MANAGER) -> bool:
    return any(
        entry.get("manager") == manager and entry.get("subresource") == "status"
        for entry in body.get("metadata", {}).get("managedFields", [])
    )


class ResourceAutoscaler:
    """The autoscaler of one M3Deployment; its API calls run in threads, one at a time."""

    def __init__(
        self,
        key: Key,
        api: Cluster,
        view: ClusterView,
        scraper: GatewayScraper,
        options: AutoscalerOptions,
        clock: Callable[[], float],
        wall_clock: Callable[[], str],
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.key = key
        self.metrics = metrics
        self.api = api
        self.view = view
        self.scraper = scraper
        self.options = options
        self.clock = clock
        self.wall_clock = wall_clock
        self.wake = asyncio.Event()  # set on every event of the resource
        self.published: dict[str, Any] | None = None  # the status last applied
        self.published_at = -math.inf
        self._forget_decisions()

    def _forget_decisions(self) -> None:
        """A resource that leaves mode Builtin starts afresh (windows, history) when it comes back."""
        self.state: AutoscalerState | None = None
        self.refused_seen: dict[str, float] = {}
        self.recent: deque[report.ScaleChange] = deque(maxlen=report.MAX_RECENT_DECISIONS)
        self.last_reason: Reason | None = None
        self.warned_generation: int | None = None

    async def run(self) -> None:
        """Until the resource is deleted (the manager cancels the task on shutdown)."""
        first = True
        while True:
            self.wake.clear()  # before reading: an event during the work below means another round
            body = self.view.m3deployment(self.key)
            if body is None:
                return
            m3d = M3Deployment.from_body(body)
            builtin = m3d.spec.engine_autoscaling.mode == report.BUILTIN and not m3d.spec.suspend
            if builtin and first:  # let the initial listing of pods arrive before the first decision
                first = False
                await asyncio.sleep(self.options.interval_s)
                continue
            first = False
            started = self.clock()
            try:
                if builtin:
                    await self.tick(m3d, body)
                else:
                    await self.publish_mode(m3d, body)
            except ApiError as error:
                logger.warning("autoscaler of %s/%s: %s", *self.key, error)
            except Exception:  # the loop must outlive any one failure
                logger.exception("autoscaler of %s/%s failed", *self.key)
            if builtin:  # a steady cadence, whatever the round took
                await asyncio.sleep(max(0.0, self.options.interval_s - (self.clock() - started)))
            else:
                await self.wake.wait()

    # --------------------------------------------------------------------------------------------

    async def tick(self, m3d: M3Deployment, body: Mapping[str, Any]) -> None:
        try:
            config = autoscaler_config(m3d.spec.engine_autoscaling)
        except ValueError as error:
            await self._invalid(m3d, body, str(error))
            return
        now = self.clock()
        current = m3d.spec.engine.replicas
        if self.state is None:
            self.state = initial_state(now, current)
        urls = self.options.targets.urls(self.key, self.view.pods(self.key, GATEWAY), m3d.spec.gateway.port)
        scrape = await self.scraper.scrape(urls) if urls else Scrape(readings={})
        cluster = engine_cluster_state(current, self.view.pods(self.key, ENGINE))
        refused = refused_since(self.refused_seen, scrape)
        if scrape.readings:
            # Requests refused while no engine is ready are demand the in-flight count cannot show:
            # this is how a deployment scaled to zero wakes up.
            demand = scrape.inflight + (refused if cluster.ready_replicas == 0 else 0.0)
            self.state = observe(self.state, now, demand, config)
        decision, self.state = decide(config, self.state, now, cluster)
        if self.metrics is not None:
            self.metrics.record_decision(self.key, decision.desired_replicas, cluster.current_replicas, decision.mode,
                                         decision.stable_concurrency)  # fmt: skip
        coverage = report.GatewayCoverage(len(urls), len(scrape.readings), scrape.failures)
        message = report.describe(decision, cluster, config, coverage)
        if decision.desired_replicas != cluster.current_replicas:
            await self._scale(m3d, body, decision, cluster, message)
        await self._announce(body, decision, message, coverage)
        await self._publish(m3d, body, report.builtin_status(decision, cluster, config, coverage, self.recent))

    async def _scale(
        self, m3d: M3Deployment, body: Mapping[str, Any], decision: Decision, cluster: ClusterState, message: str
    ) -> None:
        await asyncio.to_thread(self.api.scale, M3DEPLOYMENT, m3d.namespace, m3d.name, decision.desired_replicas)
        change = report.ScaleChange(
            time=self.wall_clock(),
            from_replicas=cluster.current_replicas,
            to_replicas=decision.desired_replicas,
            reason=decision.reason.value,
            mode=decision.mode,
            concurrency=decision.stable_concurrency,
        )
        self.recent.append(change)
        reason, text = report.scale_event(change, message)
        logger.info("%s/%s: %s", m3d.namespace, m3d.name, text)
        await asyncio.to_thread(self.api.post_event, body, "Normal", reason, text, change.time)

    async def _announce(
        self, body: Mapping[str, Any], decision: Decision, message: str, coverage: report.GatewayCoverage
    ) -> None:
        """Warnings when the situation turns bad: engines cannot be placed, metrics are gone."""
        previous, self.last_reason = self.last_reason, decision.reason
        if decision.reason == previous:
            return
        if decision.reason is Reason.INSUFFICIENT_CAPACITY:
            warning = (Reason.INSUFFICIENT_CAPACITY.value, message)
        elif decision.reason is Reason.NO_DATA and previous is not None:
            warning = (report.METRICS_UNAVAILABLE, f"no concurrency sample: {coverage.explain()}")
        else:
            return
        logger.warning("%s/%s: %s", *self.key, warning[1])
        await asyncio.to_thread(self.api.post_event, body, "Warning", *warning, self.wall_clock())

    async def _invalid(self, m3d: M3Deployment, body: Mapping[str, Any], problem: str) -> None:
        message = f"spec.autoscaling.engine is not usable: {problem}"
        await self._publish(m3d, body, report.inactive_status(report.BUILTIN, report.INVALID_CONFIGURATION, message))
        if self.warned_generation != m3d.generation:
            self.warned_generation = m3d.generation
            await asyncio.to_thread(
                self.api.post_event, body, "Warning", report.INVALID_CONFIGURATION, message, self.wall_clock()
            )

    async def publish_mode(self, m3d: M3Deployment, body: Mapping[str, Any]) -> None:
        """Status of a resource the Builtin loop does not drive."""
        self._forget_decisions()
        mode = m3d.spec.engine_autoscaling.mode
        if mode in (report.KEDA, report.HPA):
            await self._publish(m3d, body, report.external_status(m3d))
        elif mode == report.BUILTIN:  # suspended
            status = report.inactive_status(mode, report.SUSPENDED, "spec.suspend is true: engines stay at zero")
            await self._publish(m3d, body, status)
        elif owns_status_fields(body):
            # Applying nothing drops every field this manager owns; status.py reports Disabled.
            await asyncio.to_thread(self.api.apply_status, m3d.namespace, m3d.name, {})
            self.published = None

    async def _publish(self, m3d: M3Deployment, body: Mapping[str, Any], status: dict[str, Any]) -> None:
        """Applies ``status`` when something decision-worthy changed, or the numbers after a while."""
        now = self.clock()
        unchanged = self.published is not None and _material(status) == _material(self.published)
        if unchanged and (status == self.published or now - self.published_at < STATUS_REFRESH_S):
            return
        previous = body.get("status", {}).get("conditions", [])
        stamped = {
            **status,
            "conditions": [report.stamp(c, previous, self.wall_clock(), m3d.generation) for c in status["conditions"]],
        }
        await asyncio.to_thread(self.api.apply_status, m3d.namespace, m3d.name, stamped)
        self.published, self.published_at = status, now


def _material(status: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """The decision-relevant part of a status: all but the concurrency figures (and the message quoting them)."""
    autoscaling = {k: v for k, v in status.get("autoscaling", {}).items() if k not in _VOLATILE_KEYS}
    conditions = [(c["type"], c["status"], c["reason"]) for c in status.get("conditions", [])]
    return autoscaling, conditions


class Autoscalers:
    """The per-resource autoscalers, started and stopped by M3Deployment watch events."""

    def __init__(
        self,
        api: Cluster,
        options: AutoscalerOptions,
        *,
        view: ClusterView | None = None,
        scraper: GatewayScraper | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], str] = utc_now,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.options = options
        self.view = view or ClusterView()
        self.scraper = scraper or GatewayScraper(options.scrape_timeout_s)
        self.clock = clock
        self.wall_clock = wall_clock
        self._autoscalers: dict[Key, ResourceAutoscaler] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Event handlers on M3Deployments and on the operator's pods (the watches the operator has anyway)."""
        kopf.on.event(API_VERSION, PLURAL, id="autoscaler", registry=registry)(self.on_m3deployment)
        kopf.on.event("v1", "pods", labels={MANAGED_BY_LABEL: OPERATOR_NAME}, id="autoscaler-pod", registry=registry)(
            self.on_pod
        )

    async def on_m3deployment(self, event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        key = self.view.on_m3deployment(event.get("type"), plain(body))
        if self.view.m3deployment(key) is None:
            self._stop(key)
            return
        autoscaler = self._autoscalers.get(key)
        if autoscaler is None or self._tasks[key].done():
            autoscaler = ResourceAutoscaler(
                key, self.api, self.view, self.scraper, self.options, self.clock, self.wall_clock, self.metrics
            )
            self._autoscalers[key] = autoscaler
            self._tasks[key] = asyncio.create_task(autoscaler.run(), name=f"autoscaler {key[0]}/{key[1]}")
        autoscaler.wake.set()

    async def on_pod(self, event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        self.view.on_pod(event.get("type"), body)  # summarized at once: no copy of the whole pod

    def _stop(self, key: Key) -> None:
        self._autoscalers.pop(key, None)
        if self.metrics is not None:
            self.metrics.forget(key)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for key in list(self._tasks):
            self._stop(key)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.scraper.aclose()
