"""kopf wiring: which events lead to a reconcile and which only to a status refresh.

- M3Deployment created, updated or found at start-up (resume): reconcile.
- A child deleted (someone removed it, or a node drain ate a PDB...): reconcile its owner, which
  recreates it.
- A child Deployment or one of its pods changed: refresh the owner's status (readiness counts,
  InsufficientCapacity, ModelLoading...).

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
from m3stack.operator.crd import API_VERSION, GROUP, KIND, PLURAL
from m3stack.operator.reconcile import Reconciler
from m3stack.operator.render import ALL_CHILD_KINDS, DEPLOYMENT, ChildKind
from m3stack.operator.render.names import DEPLOYMENT_LABEL, MANAGED_BY_LABEL, OPERATOR_NAME

logger = logging.getLogger(__name__)

# Retry a failed reconcile after this long (kopf retries until it succeeds; the drift loop also does).
RETRY_DELAY_SECONDS = 15
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={OPERATOR_NAME}"
WATCHED_CHILD_KINDS = (*ALL_CHILD_KINDS, POD)


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """kopf's Body view as plain dicts and lists (what the render and status functions take)."""

    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: convert(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [convert(item) for item in value]
        return value

    return convert(body)


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


def build_registry(reconciler: Reconciler) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    m3deployments = (API_VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the Cluster client: in-cluster service account, else KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.resume(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    @kopf.on.create(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    @kopf.on.update(*m3deployments, backoff=RETRY_DELAY_SECONDS, registry=registry)
    def reconcile_m3deployment(body: kopf.Body, **_: Any) -> None:
        try:
            reconciler.reconcile(plain(body))
        except ApiError as error:
            raise kopf.TemporaryError(str(error), delay=RETRY_DELAY_SECONDS) from error

    @kopf.on.event(*m3deployments, registry=registry)
    def m3deployment_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":
            reconciler.forget(body["metadata"]["namespace"], body["metadata"]["name"])

    for kind in WATCHED_CHILD_KINDS:
        _register_child_watch(registry, reconciler, kind)
    return registry


def _register_child_watch(registry: kopf.OperatorRegistry, reconciler: Reconciler, kind: ChildKind) -> None:
    refreshes_status = kind in (DEPLOYMENT, POD)

    def child_event(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
        owner = owner_key(body)
        if owner is None:
            return
        if event.get("type") == "DELETED" and kind != POD:
            logger.info("%s %s/%s was deleted: reconciling its %s", kind.kind, owner[0], body["metadata"]["name"], KIND)
            reconciler.reconcile_by_key(*owner)
        elif refreshes_status:
            reconciler.refresh_status(*owner)

    # Event handlers are not retried: a failure here is logged, and the drift loop repairs what is left.
    kopf.on.event(
        *_resource(kind), labels={MANAGED_BY_LABEL: OPERATOR_NAME}, id=f"{kind.kind.lower()}-event", registry=registry
    )(child_event)
