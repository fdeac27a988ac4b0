"""Run the operator: kopf's event loop, the work queue and the drift loop, sharing one Reconciler, and
the built-in engine autoscaler (``autoscaler/daemon.py``), fed by the same watches.

With leader election (``leader.py``), a replica first waits for the Lease, serving only ``/metrics`` and
``/healthz``; once it leads it starts all of the above, and it stops them the moment it cannot renew
the Lease (then exits 1, to come back as a standby).  On SIGTERM the leader stops kopf and hands the
Lease back, so a standby takes over within one retry period.

The drift loop asks the work queue to re-reconcile every M3Deployment in the watched namespaces
every ``drift_interval_seconds``: edits to children that produced no event the operator acts on
(a scaled Deployment, a changed Service) are undone there.  The queue's few workers turn a
thousand resources into a steady trickle of requests instead of a burst.
"""

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from m3stack.operator.apply import M3DEPLOYMENT, ApiError, Cluster
from m3stack.operator.autoscaler.daemon import FIELD_MANAGER as AUTOSCALER_FIELD_MANAGER
from m3stack.operator.autoscaler.daemon import AutoscalerOptions, Autoscalers
from m3stack.operator.handlers import build_registry, configure_settings
from m3stack.operator.leader import DEFAULT_LEASE_NAME, ElectionSettings, LeaderElector
from m3stack.operator.metrics import RECONCILE, STATUS_REFRESH, OperatorHttp, OperatorMetrics
from m3stack.operator.reconcile import Reconciler
from m3stack.operator.render import Images
from m3stack.operator.render.flags import GATEWAYS_OWN_DEFAULTS, GatewayDefaults
from m3stack.operator.render.monitoring import Monitoring
from m3stack.operator.workqueue import Work, WorkQueue

logger = logging.getLogger(__name__)

# Threads draining the work queue (child deletions, status refreshes, drift checks); kopf's own
# handler threads (--workers) create and update resources.
QUEUE_WORKERS = 4
# API connections of the autoscaler (scale, status and event writes, from short-lived threads).
AUTOSCALER_CONNECTIONS = 4
# What stops the operator (kopf's own handlers take them over once it runs).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...]  # empty: every namespace
    images: Images
    drift_interval_seconds: float
    liveness_host: str
    liveness_port: int
    workers: int
    autoscaler: AutoscalerOptions = field(default_factory=AutoscalerOptions)
    leader_election: ElectionSettings | None = None  # None: this process is the only replica
    monitoring: Monitoring | None = None  # ServiceMonitors where the cluster serves them; None: never
    gateway_defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS  # for gateway settings a resource leaves unset


def api_client(connections: int) -> k8s.ApiClient:
    """In-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config;
    ``connections``: how many threads may talk to the API server at once."""
    configuration = k8s.Configuration()
    configuration.connection_pool_maxsize = connections
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=configuration)
    return k8s.ApiClient(configuration)


def _list_m3deployments(cluster: Cluster, namespaces: Sequence[str]) -> list[dict]:
    scopes: Sequence[str | None] = namespaces or [None]
    bodies = [body for namespace in scopes for body in cluster.list(M3DEPLOYMENT, namespace)]
    for body in bodies:  # list items may leave out their type; owner references need it
        body.setdefault("apiVersion", M3DEPLOYMENT.api_version)
        body.setdefault("kind", M3DEPLOYMENT.kind)
    return bodies


# Answers of a list that mean "not served yet": the CRD not registered (404), its storage (re)initializing right
# after it was created (429), the API server not ready (503).
NOT_SERVED_YET = (404, 429, 503)
API_WAIT_INTERVAL_S = 1.0


async def wait_until_served(list_fn: Callable[[], object], what: str) -> None:
    """Returns once ``list_fn`` answers (or fails otherwise: kopf then takes over as before), retrying while the
    API says it does not serve ``what`` yet.  A helm install creates the CRD and the operator together, and kopf's
    first watch of a CRD whose storage is still initializing (429) logged an ERROR, and a retry, for a new user to
    read in their first minute; the operator now says once, at INFO, what it waits for."""
    reported: set[int] = set()
    while True:
        try:
            await asyncio.to_thread(list_fn)
            return
        except ApiError as error:
            if error.status not in NOT_SERVED_YET:
                return
            if error.status not in reported:
                reported.add(error.status)
                logger.info("waiting for the API server to serve %s: %s", what, error)
        await asyncio.sleep(API_WAIT_INTERVAL_S)


async def drift_loop(cluster: Cluster, queue: WorkQueue, namespaces: Sequence[str], interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            bodies = await asyncio.to_thread(_list_m3deployments, cluster, namespaces)
        except Exception:  # the loop must outlive any one failure (API down, a bad object)
            logger.exception("drift check: cannot list M3Deployments")
            continue
        for body in bodies:
            queue.request((body["metadata"]["namespace"], body["metadata"]["name"]), Work.RECONCILE)


async def serve(options: OperatorOptions) -> int:
    """Serve until stopped; returns the exit code (1 when this replica lost its Lease while leading)."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # kopf logs every handler run at INFO: one line per child and pod event is noise, failures stay.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # httpx logs every request at INFO: the autoscaler reads each gateway every couple of seconds.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    election = options.leader_election
    metrics = OperatorMetrics(election.name if election is not None else DEFAULT_LEASE_NAME)
    leading: asyncio.Task[None] | None = None
    http = OperatorHttp(
        options.liveness_host, options.liveness_port, metrics.registry, lambda: leading is None or not leading.done()
    )
    await http.start()
    elector = None
    try:
        if election is not None:
            coordination = k8s.CoordinationV1Api(api_client(connections=1))
            elector = LeaderElector(coordination, election, on_change=metrics.set_leader)
            metrics.set_leader(False)
            logger.info("standing by for Lease %s/%s as %s", election.namespace, election.name, election.identity)
            if not await _acquire_unless_stopped(elector):
                logger.info("stopped while standing by")
                return 0
        else:
            metrics.set_leader(True)
        leading = asyncio.create_task(lead(options, metrics), name="operator")
        if elector is None:
            await leading
            return 0
        keeping = asyncio.create_task(elector.keep(), name="lease")
        await asyncio.wait({leading, keeping}, return_when=asyncio.FIRST_COMPLETED)
        if keeping.done():  # lost the Lease: stop reconciling at once, before anyone else may start
            leading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leading
            logger.error("stopped leading: %s", keeping.exception())
            return 1
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        await leading  # kopf stopped (SIGTERM): raise what it raised
        return 0
    finally:
        if elector is not None:
            await elector.release()
        await http.stop()


async def _acquire_unless_stopped(elector: LeaderElector) -> bool:
    """Waits for the Lease; False when SIGTERM or SIGINT came first.  kopf handles those signals only once it
    runs, and in a container the operator is PID 1, which the kernel does not stop on a signal it has no
    handler for: without this a standby replica ignored its pod's deletion for the whole grace period (30 s
    on every rolling update, uninstall or drain; seen on the real test node)."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    for stop_signal in STOP_SIGNALS:
        loop.add_signal_handler(stop_signal, stopped.set)
    acquiring = asyncio.create_task(elector.acquire(), name="lease")
    stopping = asyncio.create_task(stopped.wait(), name="stop-signal")
    try:
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for stop_signal in STOP_SIGNALS:
            loop.remove_signal_handler(stop_signal)
        for task in (acquiring, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return not stopped.is_set()  # stopped just as it took the Lease: serve's finally hands it back


async def lead(options: OperatorOptions, metrics: OperatorMetrics) -> None:
    """Everything that reconciles: kopf's event loop, the work queue, the drift loop, the autoscaler."""
    # kopf's handler threads, the queue's workers and the drift loop's listing.
    cluster = Cluster(api_client(connections=options.workers + QUEUE_WORKERS + 1))
    reconciler = Reconciler(
        cluster,
        options.images,
        monitoring=options.monitoring,
        api_check_interval_s=options.drift_interval_seconds,
        gateway_defaults=options.gateway_defaults,
    )
    queue = WorkQueue(
        reconcile=metrics.counted(RECONCILE, reconciler.reconcile_by_key),
        refresh_status=metrics.counted(STATUS_REFRESH, reconciler.refresh_status),
        workers=QUEUE_WORKERS,
        expected_errors=(ApiError,),
    )
    metrics.watch_queue(lambda: queue.depth)
    await wait_until_served(lambda: _list_m3deployments(cluster, options.namespaces), "M3Deployments")
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    settings.execution.max_workers = options.workers
    registry = build_registry(reconciler, queue, metrics)
    autoscaler_api = Cluster(api_client(connections=AUTOSCALER_CONNECTIONS), field_manager=AUTOSCALER_FIELD_MANAGER)
    autoscalers = Autoscalers(autoscaler_api, options.autoscaler, metrics=metrics)
    autoscalers.register(registry)
    background = [
        asyncio.create_task(queue.run(), name="workqueue"),
        asyncio.create_task(
            drift_loop(cluster, queue, options.namespaces, options.drift_interval_seconds), name="drift"
        ),
    ]
    try:
        await kopf.operator(
            registry=registry,
            settings=settings,
            # No kopf peering: leader election (leader.py) makes this the only replica that reconciles.
            standalone=True,
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
        )
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await autoscalers.close()
