"""The operator's Prometheus metrics and its HTTP port (``/metrics``, ``/healthz``), served by every replica.

Reconciles, the work queue and leader election carry controller-runtime's metric names
(``controller_runtime_reconcile_total``, ``..._errors_total``, ``..._time_seconds``, ``workqueue_depth``,
``leader_election_master_status``): the dashboards and alerts written for Go operators read ours as they
are.  The built-in autoscaler's decisions are ours (``m3stack_operator_autoscaler_*``), per M3Deployment.

``/healthz`` answers 200 while the process serves: a standby is healthy too (it waits for the Lease), and
the leader is healthy while its operator task runs.
"""

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger(__name__)

RECONCILE = "m3deployment"  # the controller label of full reconciles
STATUS_REFRESH = "m3deployment-status"  # ... and of status refreshes
QUEUE_NAME = "m3deployment"
_DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Key = tuple[str, str]
P = ParamSpec("P")
R = TypeVar("R")


class OperatorMetrics:
    def __init__(self, lease_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "controller_runtime_reconcile_total", "Total number of reconciliations per controller",
            ["controller", "result"], registry=r,
        )  # fmt: skip
        self.reconcile_errors = Counter(
            "controller_runtime_reconcile_errors_total", "Total number of reconciliation errors per controller",
            ["controller"], registry=r,
        )  # fmt: skip
        self.reconcile_seconds = Histogram(
            "controller_runtime_reconcile_time_seconds", "Length of time per reconciliation per controller",
            ["controller"], buckets=_DURATION_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("workqueue_depth", "Current depth of workqueue", ["name"], registry=r)
        self.leader = Gauge(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master.",
            ["name"], registry=r,
        ).labels(name=lease_name)  # fmt: skip
        self.decisions = Counter(
            "m3stack_operator_autoscaler_decisions_total",
            "Built-in autoscaler decisions: scale up, scale down, or keep the engine count",
            ["namespace", "name", "direction", "mode"], registry=r,
        )  # fmt: skip
        self.desired = Gauge(
            "m3stack_operator_autoscaler_desired_replicas", "Engines the built-in autoscaler last asked for",
            ["namespace", "name"], registry=r,
        )  # fmt: skip
        self.observed = Gauge(
            "m3stack_operator_autoscaler_observed_concurrency",
            "In-flight engine requests over the stable window, as the built-in autoscaler last saw them",
            ["namespace", "name"], registry=r,
        )  # fmt: skip
        for controller in (RECONCILE, STATUS_REFRESH):  # every series from the start, at 0
            self.reconcile_errors.labels(controller=controller)
            for result in ("success", "error"):
                self.reconciles.labels(controller=controller, result=result)

    @contextlib.contextmanager
    def reconciling(self, controller: str) -> Iterator[None]:
        """Counts and times one reconcile (or status refresh); an exception counts as an error."""
        started = time.perf_counter()
        try:
            yield
        except Exception:
            self.reconciles.labels(controller=controller, result="error").inc()
            self.reconcile_errors.labels(controller=controller).inc()
            raise
        else:
            self.reconciles.labels(controller=controller, result="success").inc()
        finally:
            self.reconcile_seconds.labels(controller=controller).observe(time.perf_counter() - started)

    def counted(self, controller: str, function: Callable[P, R]) -> Callable[P, R]:
        """``function`` counted and timed as one reconcile of ``controller`` per call."""

        @functools.wraps(function)
        def counted_call(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.reconciling(controller):
                return function(*args, **kwargs)

        return counted_call

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_depth.labels(name=QUEUE_NAME).set_function(depth)

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    # The autoscaler's decisions (autoscaler/daemon.py).
    def record_decision(self, key: Key, desired: int, current: int, mode: str, observed_concurrency: float) -> None:
        """One decision: the engines asked for against the ``current`` count, in ``mode`` (stable or panic), from
        the concurrency seen over the stable window."""
        namespace, name = key
        change = desired - current
        direction = "up" if change > 0 else "down" if change < 0 else "unchanged"
        self.decisions.labels(namespace=namespace, name=name, direction=direction, mode=mode).inc()
        self.desired.labels(namespace=namespace, name=name).set(desired)
        self.observed.labels(namespace=namespace, name=name).set(observed_concurrency)

    def forget(self, key: Key) -> None:
        """Drops a deleted M3Deployment's autoscaler series."""
        namespace, name = key
        for gauge in (self.desired, self.observed):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
        names = ("namespace", "name", "direction", "mode")
        series = {
            tuple(sample.labels[label] for label in names)
            for family in self.decisions.collect()
            for sample in family.samples
            if (sample.labels.get("namespace"), sample.labels.get("name")) == key
        }
        for labels in series:  # every (direction, mode) the resource had
            self.decisions.remove(*labels)


class OperatorHttp:
    """``/metrics`` and ``/healthz`` on one port."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, healthy: Callable[[], bool]) -> None:
        self.host, self.port = host, port
        self.registry = registry
        self.healthy = healthy
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics), web.get("/healthz", self._health)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("metrics and liveness on http://%s:%d (/metrics /healthz)", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok") if self.healthy() else web.Response(status=500, text="the operator stopped")
