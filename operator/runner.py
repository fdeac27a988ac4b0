"""Run the operator: kopf's event loop plus the drift loop, sharing one Reconciler.

The drift loop re-reconciles every M3Deployment in the watched namespaces every
``drift_interval_seconds``: edits to children that produced no event the operator acts on (a
changed Service port, a scaled Deployment) are undone there.  It runs the reconciles one after
another, so a thousand resources cost a steady trickle of requests instead of a burst.
"""

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from m3stack.operator.apply import M3DEPLOYMENT, ApiError, Cluster
from m3stack.operator.handlers import build_registry, configure_settings
from m3stack.operator.reconcile import Reconciler
from m3stack.operator.render import Images

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...]  # empty: every namespace
    images: Images
    drift_interval_seconds: float
    liveness_host: str
    liveness_port: int
    workers: int


def api_client() -> k8s.ApiClient:
    """In-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config."""
    configuration = k8s.Configuration()
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


async def drift_loop(
    reconciler: Reconciler, namespaces: Sequence[str], interval: float, pool: ThreadPoolExecutor
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        try:
            bodies = await loop.run_in_executor(pool, _list_m3deployments, reconciler.cluster, namespaces)
        except Exception:  # the loop must outlive any one failure (API down, a bad object)
            logger.exception("drift check: cannot list M3Deployments")
            continue
        for body in bodies:
            try:
                await loop.run_in_executor(pool, reconciler.reconcile, body)
            except ApiError as error:
                meta = body["metadata"]
                logger.warning("drift check of %s/%s failed: %s", meta["namespace"], meta["name"], error)
            except Exception:
                meta = body["metadata"]
                logger.exception("drift check of %s/%s failed", meta["namespace"], meta["name"])


async def serve(options: OperatorOptions) -> None:
    reconciler = Reconciler(Cluster(api_client()), options.images)
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    settings.execution.max_workers = options.workers
    drift_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift")
    drift = asyncio.create_task(
        drift_loop(reconciler, options.namespaces, options.drift_interval_seconds, drift_pool), name="drift"
    )
    try:
        await kopf.operator(
            registry=build_registry(reconciler),
            settings=settings,
            standalone=True,  # one replica (Recreate): no peering objects, no peering RBAC
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=f"http://{options.liveness_host}:{options.liveness_port}/healthz",
        )
    finally:
        drift.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drift
        drift_pool.shutdown(wait=False, cancel_futures=True)
