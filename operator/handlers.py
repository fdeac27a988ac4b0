"""kopf wiring: which events lead to a reconcile and which only to a status refresh.

- M3Deployment created, updated or found at start-up (resume): reconcile, in kopf's handler (so
  kopf retries it until it succeeds).
- A child deleted (someone removed it): the work queue reconciles its owner, which recreates it.
- A child Deployment changed, or a pod shows a problem (unschedulable, image pull, crash loop,
  model loading): the work queue refreshes the owner's status.  Pods that simply become ready are
  left to their Deployment's event, which follows.

No handler needs a finalizer: children are garbage-collected through their owner references, and
the drift loop (``runner.py``) is one task for all resources instead of a kopf timer per resource
(kopf puts a finalizer on every resource that has a timer, and a finalizer makes deleting a
resource hang whenever the operator is down).
"""

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from m3stack.operator.apply import PLURALS, POD, ApiError
from m3stack.operator.crd import API_VERSION, GROUP, PLURAL
from m3stack.operator.metrics import RECONCILE, OperatorMetrics
from m3stack.operator.objects import plain
from m3stack.operator.reconcile import Reconciler
from m3stack.operator.render import ALL_CHILD_KINDS, DEPLOYMENT, OPTIONAL_CHILD_KINDS, ChildKind
from m3stack.operator.render.names import COMPONENT_LABEL, DEPLOYMENT_LABEL, ENGINE, MANAGED_BY_LABEL, OPERATOR_NAME
from m3stack.operator.status import pod_problem
from m3stack.operator.workqueue import Work, WorkQueue

logger = logging.getLogger(__name__)

# Retry a failed reconcile after this long (kopf retries until it succeeds; the drift loop also does).
RETRY_DELAY_SECONDS = 15
# Status refreshes wait this long for more events of the same resource (a rollout sends several).
REFRESH_DELAY_SECONDS = 0.5
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={OPERATOR_NAME}"
# A kind whose CRD may be missing (KEDA's ScaledObject) is not watched, which would warn at every start
# in clusters without it; the drift loop recreates a deleted one.
WATCHED_CHILD_KINDS = (*(kind for kind in ALL_CHILD_KINDS if kind not in OPTIONAL_CHILD_KINDS), POD)


def owner_key(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (namespace, name) of the M3Deployment a child or pod belongs to, from its labels."""
    meta = body.get("metadata", {})
    name = meta.get("labels", {}).get(DEPLOYMENT_LABEL)
    namespace = meta.get("namespace")
    return (namespace, name) if name and namespace else None


def _resource(kind: ChildKind) -> tuple[str, str]:
    return kind.api_version, PLURALS[kind.kind]


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Persistence in annotations under our own prefix, and server-side filtered watches."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    # Watch only the operator's own children and pods, not every Deployment and Pod of the cluster.
    for kind in WATCHED_CHILD_KINDS:
        settings.watching.label_selectors[_resource(kind)] = MANAGED_SELECTOR


def build_registry(
    reconciler: Reconciler, queue: WorkQueue, metrics: OperatorMetrics | None = None
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    m3deployments = (API_VERSION, PLURAL)
    reconcile = reconciler.reconcile if metrics is None else metrics.counted(RECONCILE, reconciler.reconcile)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the Cluster client: in-cluster service account, else KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.resume(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    @kopf.on.create(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    @kopf.on.update(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    def reconcile_m3deployment(body: kopf.Body, **_: Any) -> None:
        try:
            reconcile(plain(body))
        except ApiError as error:
            raise kopf.TemporaryError(str(error), delay=RETRY_DELAY_SECONDS) from error

    @kopf.on.event(*m3deployments, registry=registry)
    def m3deployment_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":
            reconciler.forget(body["metadata"]["namespace"], body["metadata"]["name"])

    for kind in WATCHED_CHILD_KINDS:
        _register_child_watch(registry, queue, kind)
    return registry


def child_work(kind: ChildKind, event_type: str | None, body: Mapping[str, Any]) -> Work | None:
    """What a child's or pod's event asks of its owner, if anything."""
    if kind == POD:
        model_loads = body.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL) == ENGINE
        return Work.REFRESH_STATUS if pod_problem(body, model_loads=model_loads) is not None else None
    if event_type == "DELETED":
        return Work.RECONCILE
    return Work.REFRESH_STATUS if kind == DEPLOYMENT else None


def _register_child_watch(registry: kopf.OperatorRegistry, queue: WorkQueue, kind: ChildKind) -> None:
    async def child_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        owner = owner_key(body)
        work = child_work(kind, event.get("type"), body)
        if owner is not None and work is not None:
            queue.request(owner, work, delay=REFRESH_DELAY_SECONDS if work == Work.REFRESH_STATUS else 0.0)

    kopf.on.event(
        *_resource(kind), labels={MANAGED_BY_LABEL: OPERATOR_NAME}, id=f"{kind.kind.lower()}-event", registry=registry
    )(child_event)
