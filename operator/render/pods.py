"""Pod-level pieces shared by the gateway and engine pod templates."""

from typing import Any

from m3stack.operator.render.names import (
    CONFIG,
    CONFIG_HASH_ANNOTATION,
    child_metadata,
    child_name,
    labels,
    selector_labels,
)
from m3stack.operator.spec import Drain, M3Deployment, Scheduling

# Both images run as this non-root user (images/*.Dockerfile).
RUN_AS_USER = 10001
MODEL_VOLUME = "model"
TMP_VOLUME = "tmp"


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def environment(user_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spec's variables, after ours unless they set the same name (theirs win).

    The root filesystem is read-only, so caches (Triton, FlashInfer JIT, HF) go under a writable /tmp.
    """
    ours = [{"name": "HOME", "value": "/tmp"}]
    names = {variable["name"] for variable in user_env}
    return [*(variable for variable in ours if variable["name"] not in names), *user_env]


def m3stack_container(
    m3d: M3Deployment, component: str, image: str, pull_policy: str, args: list[str], user_env: list[dict[str, Any]]
) -> dict[str, Any]:
    """The part every `m3stack <command>` container shares: settings rendered into the ConfigMap reach
    the process as M3STACK_<COMMAND>_<FLAG> variables, the root filesystem is read-only."""
    return {
        "name": component,
        "image": image,
        "imagePullPolicy": pull_policy,
        "args": args,
        "envFrom": [{"configMapRef": {"name": child_name(m3d, CONFIG)}}],
        "env": environment(user_env),
        "securityContext": container_security_context(),
        # A container that exits with an error leaves its log's tail in lastState.terminated.message, where the
        # operator reads why a pod crash-loops (status.pod_problem) for the resource's conditions and events.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def deployment(
    m3d: M3Deployment,
    component: str,
    *,
    replicas: int | None,
    strategy: dict[str, Any],
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    drain: Drain,
    scheduling: dict[str, Any],
    config_hash: str,
    extra_spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A component's Deployment; ``replicas=None`` leaves the field to an autoscaler."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(m3d, component)},
        "strategy": strategy,
        "revisionHistoryLimit": 3,
        **(extra_spec or {}),
        "template": {
            "metadata": {"labels": labels(m3d, component), "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
            "spec": {
                "containers": [container],
                "volumes": volumes,
                "terminationGracePeriodSeconds": drain.termination_grace_period_seconds,
                "securityContext": pod_security_context(),
                # Pods find engines through DNS; thousands of service variables would only slow starts.
                "enableServiceLinks": False,
                "automountServiceAccountToken": False,
                **scheduling,
            },
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(m3d, component),
        "spec": spec,
    }


def pre_stop(drain: Drain) -> dict[str, Any]:
    """Keep serving while endpoints and routers drop the pod; SIGTERM (and the process's drain) follows."""
    if drain.pre_stop_seconds == 0:
        return {}
    return {"lifecycle": {"preStop": {"sleep": {"seconds": drain.pre_stop_seconds}}}}


def model_volumes(m3d: M3Deployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the checkpoint claim read-only (when there is one) and a writable /tmp."""
    volumes: list[dict[str, Any]] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": TMP_VOLUME, "mountPath": "/tmp"}]
    model = m3d.spec.model
    if model.pvc_claim_name is not None:
        volumes.append(
            {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": model.pvc_claim_name, "readOnly": True}}
        )
        mounts.append({"name": MODEL_VOLUME, "mountPath": model.pvc_mount_path, "readOnly": True})
    return volumes, mounts


def scheduling_fields(
    scheduling: Scheduling,
    extra_node_selector: dict[str, str] | None = None,
    extra_tolerations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """nodeSelector, tolerations and priorityClassName, leaving out what is empty."""
    node_selector = {**(extra_node_selector or {}), **scheduling.node_selector}
    tolerations = [*scheduling.tolerations, *(extra_tolerations or [])]
    fields: dict[str, Any] = {}
    if node_selector:
        fields["nodeSelector"] = node_selector
    if tolerations:
        fields["tolerations"] = tolerations
    if scheduling.priority_class_name:
        fields["priorityClassName"] = scheduling.priority_class_name
    return fields


def pod_disruption_budget(m3d: M3Deployment, component: str) -> dict[str, Any]:
    """At most one pod of the component down for voluntary disruptions (node drains, upgrades).

    Unhealthy pods may always be evicted: an engine whose model never loads must not block a drain.
    """
    selector = {"matchLabels": selector_labels(m3d, component)}
    spec = {"maxUnavailable": 1, "selector": selector, "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(m3d, component),
        "spec": spec,
    }
