"""What the autoscaler knows of the cluster: M3Deployments and their pods, kept current by the
operator's watch events (kopf delivers every event of the watched kinds, the initial listing
included), so a decision every tick costs no API request.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from m3stack.operator.autoscaler.algorithm import ClusterState
from m3stack.operator.render.names import COMPONENT_LABEL, DEPLOYMENT_LABEL

Key = tuple[str, str]  # (namespace, name) of an M3Deployment
DELETED = "DELETED"


@dataclass(frozen=True)
class PodSummary:
    """The few facts about a pod the autoscaler acts on."""

    name: str
    component: str
    phase: str
    ready: bool
    unschedulable: bool
    terminating: bool
    pod_ip: str | None


def pod_owner(body: Mapping[str, Any]) -> Key | None:
    meta = body.get("metadata", {})
    name = meta.get("labels", {}).get(DEPLOYMENT_LABEL)
    return (meta["namespace"], name) if name and meta.get("namespace") else None


def summarize_pod(body: Mapping[str, Any]) -> PodSummary:
    meta, status = body.get("metadata", {}), body.get("status", {})
    conditions = {c.get("type"): c for c in status.get("conditions", [])}
    scheduled = conditions.get("PodScheduled", {})
    return PodSummary(
        name=meta.get("name", ""),
        component=meta.get("labels", {}).get(COMPONENT_LABEL, ""),
        phase=status.get("phase", "Pending"),
        ready=conditions.get("Ready", {}).get("status") == "True",
        unschedulable=scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable",
        terminating=bool(meta.get("deletionTimestamp")),
        pod_ip=status.get("podIP") or None,
    )


def engine_cluster_state(current_replicas: int, engine_pods: list[PodSummary]) -> ClusterState:
    """The algorithm's view of the engines: pods on their way out count for nothing."""
    live = [pod for pod in engine_pods if not pod.terminating]
    return ClusterState(
        current_replicas=current_replicas,
        ready_replicas=sum(pod.ready for pod in live),
        pending_pods=sum(pod.phase == "Pending" for pod in live),
        unschedulable_pods=sum(pod.unschedulable for pod in live),
    )


class ClusterView:
    """M3Deployment bodies and pod summaries by owner, from watch events."""

    def __init__(self) -> None:
        self._resources: dict[Key, dict[str, Any]] = {}
        self._pods: dict[Key, dict[str, PodSummary]] = {}

    def on_m3deployment(self, event_type: str | None, body: Mapping[str, Any]) -> Key:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == DELETED:
            self._resources.pop(key, None)
            self._pods.pop(key, None)
        else:
            self._resources[key] = dict(body)
        return key

    def on_pod(self, event_type: str | None, body: Mapping[str, Any]) -> Key | None:
        owner = pod_owner(body)
        if owner is None:
            return None
        name = body["metadata"]["name"]
        if event_type != DELETED:
            self._pods.setdefault(owner, {})[name] = summarize_pod(body)
        elif owner in self._pods:
            self._pods[owner].pop(name, None)
            if not self._pods[owner]:
                del self._pods[owner]
        return owner

    def m3deployment(self, key: Key) -> dict[str, Any] | None:
        return self._resources.get(key)

    def pods(self, key: Key, component: str) -> list[PodSummary]:
        return [pod for pod in self._pods.get(key, {}).values() if pod.component == component]
