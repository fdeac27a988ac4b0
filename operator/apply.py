"""The operator's only door to the API server: server-side apply, reads, deletes, status, events.

A thin layer over ``kubernetes.client.ApiClient`` (which handles kubeconfig, in-cluster tokens and
their rotation): raw JSON in and out, one path per kind from a fixed table, so there is no
discovery round-trip and the table doubles as the list of what the operator touches (the Helm
chart's ClusterRole is tested against ``REQUIRED_RULES``).
"""

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s

from m3stack.operator.crd import API_VERSION, GROUP, KIND, PLURAL
from m3stack.operator.render import ALL_CHILD_KINDS, ChildKind, kind_of
from m3stack.operator.render.names import OPERATOR_NAME

logger = logging.getLogger(__name__)

POD = ChildKind("v1", "Pod")
EVENT = ChildKind("v1", "Event")
M3DEPLOYMENT = ChildKind(API_VERSION, KIND)
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "Ingress": "ingresses",
    "NetworkPolicy": "networkpolicies",
    "ScaledObject": "scaledobjects",
    "LeaderWorkerSet": "leaderworkersets",
    "ServiceMonitor": "servicemonitors",
    "Pod": "pods",
    "Event": "events",
    KIND: PLURAL,
}
REQUEST_TIMEOUT_SECONDS = 30


def api_group(kind: ChildKind) -> str:
    """``apps/v1`` -> ``apps``; ``v1`` -> ``""`` (the core group)."""
    return kind.api_version.rpartition("/")[0]


@dataclass(frozen=True)
class Rule:
    """One RBAC rule: what the operator does to some resources of one API group."""

    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]


def _child_rules() -> tuple[Rule, ...]:
    # Server-side apply creates and patches, the watch sees deletions, pruning reads then deletes.
    verbs = ("create", "delete", "get", "list", "patch", "watch")
    groups = sorted({api_group(kind) for kind in ALL_CHILD_KINDS})
    return tuple(
        Rule(group, tuple(sorted(PLURALS[k.kind] for k in ALL_CHILD_KINDS if api_group(k) == group)), verbs)
        for group in groups
    )


# What the operator does, hence exactly what its ClusterRole grants (tests/operator/test_chart.py).
REQUIRED_RULES: tuple[Rule, ...] = (
    # kopf patches its progress annotations on the resources it serves; status is written separately.
    Rule(GROUP, (PLURAL,), ("get", "list", "patch", "watch")),
    Rule(GROUP, (f"{PLURAL}/status",), ("get", "patch")),
    # The built-in autoscaler sets spec.engine.replicas through /scale, as kubectl scale, HPA and KEDA do.
    Rule(GROUP, (f"{PLURAL}/scale",), ("patch",)),
    # kopf watches CRDs to learn when the resource it serves is installed, and namespaces to
    # resolve --namespace (cluster-scoped reads, the only ones).
    Rule("apiextensions.k8s.io", ("customresourcedefinitions",), ("list", "watch")),
    Rule("", ("namespaces",), ("list", "watch")),
    *_child_rules(),
    # Pods explain why a component is not ready (unschedulable, image pull, model loading).
    Rule("", ("pods",), ("list", "watch")),
    Rule("", ("events",), ("create",)),
)


class ApiError(RuntimeError):
    """A request the API server refused; ``status`` is the HTTP code, the message is the server's."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


def _path(kind: ChildKind, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    prefix = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
    parts = [prefix]
    if namespace is not None:
        parts += ["namespaces", namespace]
    parts.append(PLURALS[kind.kind])
    if name is not None:
        parts.append(name)
    if subresource is not None:
        parts.append(subresource)
    return "/".join(parts)


class Cluster:
    """Typed requests against one API server; every method is one HTTP call."""

    def __init__(self, api_client: k8s.ApiClient, field_manager: str = OPERATOR_NAME) -> None:
        self.api_client = api_client
        self.field_manager = field_manager

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*serialized, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        data = response.read()
        if not 200 <= response.status < 300:
            # A Status object, or plain text from outside the API machinery ("404 page not found" for an
            # API group that is not installed).
            try:
                status = json.loads(data)
            except ValueError:
                status = {"message": data.decode(errors="replace").strip()}
            raise ApiError(response.status, status.get("reason", response.reason or ""), status.get("message", ""))
        return json.loads(data) if data else {}

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: the object becomes what ``manifest`` says for every field it names.

        ``force`` takes over fields another manager set (a ``kubectl edit`` of a child): the
        operator's rendering is the truth for what it renders, and nothing else.
        """
        meta = manifest["metadata"]
        return self._request(
            "PATCH",
            _path(kind_of(dict(manifest)), meta["namespace"], meta["name"]),
            query={"fieldManager": self.field_manager, "force": "true"},
            body=manifest,
            content_type="application/apply-patch+yaml",
        )

    def get(self, kind: ChildKind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", _path(kind, namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list(self, kind: ChildKind, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return list(self._request("GET", _path(kind, namespace), query=query).get("items", []))

    def delete(self, kind: ChildKind, namespace: str, name: str, uid: str) -> None:
        """Deletes exactly the object with this uid (a replacement created meanwhile survives)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            self._request("DELETE", _path(kind, namespace, name), body=body, content_type="application/json")
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    def serves(self, kind: ChildKind) -> bool:
        """Whether the API server serves ``kind`` (its CRD is installed): one read of its group version."""
        try:
            resources = self._request("GET", f"/apis/{kind.api_version}").get("resources", [])
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return any(resource.get("name") == PLURALS[kind.kind] for resource in resources)

    def scale(self, kind: ChildKind, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Sets the replicas of a resource through its /scale subresource; returns the Scale object."""
        return self._request(
            "PATCH",
            _path(kind, namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def apply_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Server-side apply to the status subresource: the fields and conditions (a list keyed by
        type) named here become this manager's; those of other writers stay as they are."""
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}}
        self._request(
            "PATCH",
            _path(M3DEPLOYMENT, namespace, name, "status"),
            query={"fieldManager": self.field_manager, "force": "true"},
            body={**body, "status": status},
            content_type="application/apply-patch+yaml",
        )

    def post_event(self, owner: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        """A core/v1 Event on ``owner`` (shown by ``kubectl describe m3d``); failures are only logged."""
        meta = owner["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": owner.get("apiVersion", API_VERSION),
                "kind": owner.get("kind", KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.field_manager},
            "reportingComponent": self.field_manager,
            "reportingInstance": self.field_manager,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._request("POST", _path(EVENT, meta["namespace"]), body=event, content_type="application/json")
        except ApiError as error:
            logger.warning("could not post event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], error)
