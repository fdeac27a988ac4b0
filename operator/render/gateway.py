"""The gateway tier: Deployment (CPU pods), Service, optional CPU HorizontalPodAutoscaler, PodDisruptionBudget."""

from typing import Any

from m3stack.operator.render import pods
from m3stack.operator.render.autoscaling import horizontal_pod_autoscaler
from m3stack.operator.render.flags import API_KEYS_DIR, gateway_args
from m3stack.operator.render.names import GATEWAY, child_metadata, child_name, selector_labels
from m3stack.operator.spec import M3Deployment

HTTP_PORT_NAME = "http"
API_KEYS_VOLUME = "api-keys"


def gateway_replicas_owned_by_hpa(m3d: M3Deployment) -> bool:
    """While the HPA runs, the Deployment's replicas are the HPA's: the operator leaves them out."""
    return m3d.spec.gateway_autoscaling.enabled and not m3d.spec.suspend


def _container(m3d: M3Deployment, image: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    gateway = m3d.spec.gateway
    return {
        **pods.m3stack_container(m3d, GATEWAY, image, gateway.pull_policy, gateway_args(m3d), gateway.env),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": gateway.port, "protocol": "TCP"}],
        # Loading the tokenizer and chat template takes seconds, not minutes.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 60,
        },
        # /ready is false while no engine is reachable: no traffic to a gateway that can only fail it.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": HTTP_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
        **pods.pre_stop(gateway.drain),
        "resources": {
            bucket: values
            for bucket, values in (("requests", gateway.resources.requests), ("limits", gateway.resources.limits))
            if values
        },
        "volumeMounts": mounts,
    }


def gateway_deployment(m3d: M3Deployment, image: str, config_hash: str) -> dict[str, Any]:
    gateway = m3d.spec.gateway
    volumes, mounts = pods.model_volumes(m3d)
    if gateway.api_key_secret is not None:
        volumes.append({"name": API_KEYS_VOLUME, "secret": {"secretName": gateway.api_key_secret.name}})
        mounts.append({"name": API_KEYS_VOLUME, "mountPath": API_KEYS_DIR, "readOnly": True})
    return pods.deployment(
        m3d,
        GATEWAY,
        replicas=None if gateway_replicas_owned_by_hpa(m3d) else 0 if m3d.spec.suspend else gateway.replicas,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
        container=_container(m3d, image, mounts),
        volumes=volumes,
        drain=gateway.drain,
        scheduling=pods.scheduling_fields(gateway.scheduling),
        config_hash=config_hash,
    )


def gateway_service(m3d: M3Deployment) -> dict[str, Any]:
    port = m3d.spec.gateway.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(m3d, GATEWAY),
        "spec": {
            "type": m3d.spec.exposure.service_type,
            "selector": selector_labels(m3d, GATEWAY),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": port,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def gateway_autoscaler(m3d: M3Deployment) -> dict[str, Any]:
    scaling = m3d.spec.gateway_autoscaling
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(m3d, GATEWAY)}
    cpu = {
        "type": "Resource",
        "resource": {
            "name": "cpu",
            "target": {"type": "Utilization", "averageUtilization": scaling.target_cpu_utilization_percentage},
        },
    }
    return horizontal_pod_autoscaler(m3d, GATEWAY, deployment, (scaling.min_replicas, scaling.max_replicas), cpu)


def gateway_disruption_budget(m3d: M3Deployment) -> dict[str, Any]:
    return pods.pod_disruption_budget(m3d, GATEWAY)
