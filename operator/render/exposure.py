"""The Ingress in front of the gateway Service."""

from typing import Any

from m3stack.operator.render.gateway import HTTP_PORT_NAME
from m3stack.operator.render.names import GATEWAY, child_name, ingress_name, labels
from m3stack.operator.spec import Ingress, M3Deployment


def ingress(m3d: M3Deployment, spec: Ingress) -> dict[str, Any]:
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": spec.path,
                    "pathType": "Prefix",
                    "backend": {"service": {"name": child_name(m3d, GATEWAY), "port": {"name": HTTP_PORT_NAME}}},
                }
            ]
        }
    }
    if spec.host:
        rule["host"] = spec.host
    body: dict[str, Any] = {"rules": [rule]}
    if spec.class_name:
        body["ingressClassName"] = spec.class_name
    if spec.tls_secret_name:
        body["tls"] = [{"hosts": [spec.host], "secretName": spec.tls_secret_name}]
    metadata: dict[str, Any] = {"name": ingress_name(m3d), "namespace": m3d.namespace, "labels": labels(m3d, GATEWAY)}
    if spec.annotations:
        metadata["annotations"] = dict(spec.annotations)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": metadata, "spec": body}
