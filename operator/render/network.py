"""The engines' NetworkPolicy: who may open connections to the engine pods.

An engine trusts its gRPC callers: a media item's ``content_hash`` names its embeddings in the encoder and
prefix caches, so a caller that could send another item's hash with its own pixels would poison what
later requests for that item receive.  Only this resource's gateways reach the gRPC port; the engine pods
of the resource reach each other on any port (the ranks of a multi-node group: rendezvous and NCCL); the
metrics port (``/metrics``, ``/loaded``, ``/health``) stays open to the cluster's monitoring and probes.
Enforced by the cluster's network plugin (a plugin without NetworkPolicy support ignores it).
"""

from typing import Any

from m3stack.operator.render.engine import GRPC_PORT_NAME, METRICS_PORT_NAME
from m3stack.operator.render.names import ENGINE, GATEWAY, child_metadata, selector_labels
from m3stack.operator.spec import M3Deployment


def engine_network_policy(m3d: M3Deployment) -> dict[str, Any]:
    def tcp(port: str) -> dict[str, str]:
        return {"protocol": "TCP", "port": port}

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(m3d, ENGINE),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(m3d, ENGINE)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(m3d, GATEWAY)}}],
                    "ports": [tcp(GRPC_PORT_NAME)],
                },
                {"from": [{"podSelector": {"matchLabels": selector_labels(m3d, ENGINE)}}]},
                {"ports": [tcp(METRICS_PORT_NAME)]},
            ],
        },
    }
