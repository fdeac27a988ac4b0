"""Run the operator: kopf's event loop, the work queue and the drift loop, sharing one Reconciler, and
the built-in engine autoscaler (``autoscaler/daemon.py``), fed by the same watches.

The drift loop asks the work queue to re-reconcile every M3Deployment in the watched namespaces
every ``drift_interval_seconds``: edits to children that produced no event the operator acts on
(a scaled Deployment, a changed Service) are undone there.  The queue's few workers turn a
thousand resources into a steady trickle of requests instead of a burst.
"""

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from m3stack.operator.apply import M3DEPLOYMENT, ApiError, Cluster
from m3stack.operator.autoscaler.daemon import FIELD_MANAGER as AUTOSCALER_FIELD_MANAGER
from m3stack.operator.autoscaler.daemon import AutoscalerOptions, Autoscalers
from m3stack.operator.handlers import build_registry, configure_settings
from m3stack.operator.reconcile import Reconciler
from m3stack.operator.render import Images
from m3stack.operator.workqueue import Work, WorkQueue

logger = logging.getLogger(__name__)

# Threads draining the work queue (child deletions, status refreshes, drift checks); kopf's own
# handler threads (--workers) create and update resources.
QUEUE_WORKERS = 4
# API connections of the autoscaler (scale, status and event writes, from short-lived threads).
AUTOSCALER_CONNECTIONS = 4


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...]  # empty: every namespace
    images: Images
    drift_interval_seconds: float
    liveness_host: str
    liveness_port: int
    workers: int
    autoscaler: AutoscalerOptions = field(default_factory=AutoscalerOptions)


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


async def serve(options: OperatorOptions) -> None:
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # kopf logs every handler run at INFO: one line per child and pod event is noise, failures stay.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # httpx logs every request at INFO: the autoscaler reads each gateway every couple of seconds.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    # kopf's handler threads, the queue's workers and the drift loop's listing.
    cluster = Cluster(api_client(connections=options.workers + QUEUE_WORKERS + 1))
    reconciler = Reconciler(cluster, options.images)
    queue = WorkQueue(
        reconcile=reconciler.reconcile_by_key,
        refresh_status=reconciler.refresh_status,
        workers=QUEUE_WORKERS,
        expected_errors=(ApiError,),
    )
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    settings.execution.max_workers = options.workers
    registry = build_registry(reconciler, queue)
    autoscaler_api = Cluster(api_client(connections=AUTOSCALER_CONNECTIONS), field_manager=AUTOSCALER_FIELD_MANAGER)
    autoscalers = Autoscalers(autoscaler_api, options.autoscaler)
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
            standalone=True,  # one replica (Recreate): no peering objects, no peering RBAC
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=f"http://{options.liveness_host}:{options.liveness_port}/healthz",
        )
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await autoscalers.close()
