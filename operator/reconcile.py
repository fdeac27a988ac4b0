"""One idempotent reconcile: render the children, adopt them, apply them server-side, prune what is no
longer wanted, then write the status from what is observed.

Every path into the operator (create/update/resume of an M3Deployment, a deleted child, the drift
loop) ends in ``Reconciler.reconcile``; child and pod changes only refresh the status.  Work on one
M3Deployment is serialized by a per-object lock (kopf's handler threads and the work queue's).
"""

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from m3stack.operator.apply import M3DEPLOYMENT, POD, ApiError, Cluster
from m3stack.operator.objects import utc_now
from m3stack.operator.render import (
    ALL_CHILD_KINDS,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    OPTIONAL_CHILD_KINDS,
    SERVICE_MONITOR,
    SHARED_CHILD_KINDS,
    WORKLOAD_KINDS,
    ChildKind,
    Images,
    kind_of,
    render_children,
)
from m3stack.operator.render.flags import GATEWAYS_OWN_DEFAULTS, GatewayDefaults
from m3stack.operator.render.monitoring import Monitoring
from m3stack.operator.render.multinode import is_multi_node, workload_view
from m3stack.operator.render.names import COMPONENT_LABEL, DEPLOYMENT_LABEL, ENGINE
from m3stack.operator.spec import M3Deployment
from m3stack.operator.status import DEGRADED, RECONCILE_FAILED, Observed, compute_status, needs_pods, status_changed

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(
        ref.get("controller") and ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", [])
    )


def _last_reconcile_error(status: Mapping[str, Any]) -> str | None:
    """A status refresh does not apply anything, so it keeps the last reconcile's verdict."""
    for condition in status.get("conditions", []):
        if condition.get("type") == DEGRADED and condition.get("reason") == RECONCILE_FAILED:
            return str(condition.get("message", "reconcile failed"))
    return None


class Reconciler:
    def __init__(
        self,
        cluster: Cluster,
        images: Images,
        clock: Callable[[], str] = utc_now,
        monitoring: Monitoring | None = None,
        api_check_interval_s: float = 60.0,
        gateway_defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS,
    ) -> None:
        """``monitoring``: how to render ServiceMonitors, when the cluster serves them (None: never); whether it
        does is checked at most every ``api_check_interval_s``, so installing the Prometheus Operator later is
        noticed by the next drift reconcile.  ``gateway_defaults``: the gateway settings of resources that leave
        them unset."""
        self.cluster = cluster
        self.images = images
        self.gateway_defaults = gateway_defaults
        self.clock = clock
        self.monitoring = monitoring
        self._api_check_interval_s = api_check_interval_s
        self._monitoring_served: tuple[float, bool] | None = None  # (checked at, served)
        self._locks: dict[Key, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _monitoring(self) -> Monitoring | None:
        if self.monitoring is None:
            return None
        now = time.monotonic()
        if self._monitoring_served is None or now - self._monitoring_served[0] >= self._api_check_interval_s:
            served = self.cluster.serves(SERVICE_MONITOR)
            if self._monitoring_served is None or served != self._monitoring_served[1]:
                logger.info("the cluster %s ServiceMonitors", "serves" if served else "does not serve")
            self._monitoring_served = (now, served)
        return self.monitoring if self._monitoring_served[1] else None

    def _lock(self, key: Key) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """Drops per-object state once the M3Deployment is gone."""
        with self._locks_guard:
            self._locks.pop((namespace, name), None)

    # --------------------------------------------------------------------------------------------

    def reconcile(self, body: Mapping[str, Any]) -> None:
        """Makes the children match ``body``'s spec; raises ApiError (recorded in status) if it cannot."""
        meta = body["metadata"]
        with self._lock((meta["namespace"], meta["name"])):
            if meta.get("deletionTimestamp"):
                return  # the garbage collector is removing the children; do not bring them back
            m3d = M3Deployment.from_body(body)
            children = render_children(m3d, self.images, self._monitoring(), self.gateway_defaults)
            # Ownership only: names and namespaces are rendered, and the resource's own labels are not
            # copied into pod templates (editing them would roll every pod).
            kopf.append_owner_reference(children, owner=dict(body))
            try:
                applied = [self.cluster.apply(child) for child in children]
                self._prune(m3d, children)
            except ApiError as error:
                logger.warning("reconciling %s/%s failed: %s", m3d.namespace, m3d.name, error)
                previous_generation = int(body.get("status", {}).get("observedGeneration", 0))
                self._write_status(body, m3d, observed_generation=previous_generation, reconcile_error=str(error))
                raise
            logger.debug("reconciled %s/%s: %d children applied", m3d.namespace, m3d.name, len(children))
            # The apply responses are the workloads as they are now: no need to read them again.
            deployments = [child for child in applied if kind_of(child) in WORKLOAD_KINDS]
            self._write_status(body, m3d, observed_generation=m3d.generation, reconcile_error=None, seen=deployments)

    def reconcile_by_key(self, namespace: str, name: str) -> None:
        """Reconciles the current version of a resource (after a child was deleted, or from the drift loop)."""
        body = self.cluster.get(M3DEPLOYMENT, namespace, name)
        if body is not None:
            self.reconcile(body)

    def refresh_status(self, namespace: str, name: str) -> None:
        """Rewrites the status from the observed children (after a child or pod changed)."""
        with self._lock((namespace, name)):
            body = self.cluster.get(M3DEPLOYMENT, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            status = body.get("status", {})
            self._write_status(
                body,
                M3Deployment.from_body(body),
                observed_generation=int(status.get("observedGeneration", 0)),
                reconcile_error=_last_reconcile_error(status),
            )

    # --------------------------------------------------------------------------------------------

    def _prune(self, m3d: M3Deployment, children: list[dict[str, Any]]) -> None:
        """Deletes children no longer rendered (an HPA after autoscaling is turned off, an Ingress after
        exposure.ingress is removed).  Rendered children keep their fixed names, so only the absent kinds,
        and the kinds a resource can own several of, can hold leftovers."""
        rendered = {(kind_of(child), child["metadata"]["name"]) for child in children}
        rendered_kinds = {kind for kind, _ in rendered}
        for kind in ALL_CHILD_KINDS:
            if kind in rendered_kinds and kind not in SHARED_CHILD_KINDS:
                continue
            for stale in self._list_children(kind, m3d):
                meta = stale["metadata"]
                if (kind, meta["name"]) not in rendered and controlled_by(stale, m3d.uid):
                    logger.info("deleting %s %s/%s: no longer wanted", kind.kind, m3d.namespace, meta["name"])
                    self.cluster.delete(kind, m3d.namespace, meta["name"], meta["uid"])

    def _list_children(self, kind: ChildKind, m3d: M3Deployment) -> list[dict[str, Any]]:
        try:
            return self.cluster.list(kind, m3d.namespace, f"{DEPLOYMENT_LABEL}={m3d.name}")
        except ApiError as error:
            if error.status == 404 and kind in OPTIONAL_CHILD_KINDS:
                return []  # the kind's CRD is not installed, so nothing of it exists
            raise

    def _observe(self, m3d: M3Deployment, reconcile_error: str | None, seen: list[dict[str, Any]] | None) -> Observed:
        selector = f"{DEPLOYMENT_LABEL}={m3d.name}"
        candidates = seen
        if candidates is None:
            candidates = self.cluster.list(DEPLOYMENT, m3d.namespace, selector)
            if is_multi_node(m3d):  # the engines are a LeaderWorkerSet (a Deployment left from before is pruned)
                candidates = [c for c in candidates if c["metadata"].get("labels", {}).get(COMPONENT_LABEL) != ENGINE]
                candidates += self._list_children(LEADER_WORKER_SET, m3d)
        deployments = {
            deployment["metadata"]["labels"][COMPONENT_LABEL]: workload_view(deployment)
            for deployment in candidates
            if controlled_by(deployment, m3d.uid) and COMPONENT_LABEL in deployment["metadata"].get("labels", {})
        }
        pods = self.cluster.list(POD, m3d.namespace, selector) if needs_pods(m3d, deployments) else []
        return Observed(deployments=deployments, pods=pods, reconcile_error=reconcile_error)

    def _write_status(
        self,
        body: Mapping[str, Any],
        m3d: M3Deployment,
        *,
        observed_generation: int,
        reconcile_error: str | None,
        seen: list[dict[str, Any]] | None = None,
    ) -> None:
        """Writes the status from the children; ``seen``: the Deployments as just read, if they were."""
        now = self.clock()
        previous = body.get("status", {})
        observed = self._observe(m3d, reconcile_error, seen)
        status, transitions = compute_status(m3d, observed, previous, observed_generation=observed_generation, now=now)
        if status_changed(status, previous):
            self.cluster.apply_status(m3d.namespace, m3d.name, status)
        for transition in transitions:
            # The log tells what the Events tell: a reader of the operator's log sees each resource's state.
            logger.log(
                logging.INFO if transition.healthy else logging.WARNING,
                "%s/%s: %s is %s (%s): %s",
                m3d.namespace,
                m3d.name,
                transition.type,
                transition.status,
                transition.reason,
                transition.message,
            )
            self.cluster.post_event(
                body,
                "Normal" if transition.healthy else "Warning",
                transition.reason,
                f"{transition.type} is {transition.status}: {transition.message}",
                now,
            )
