"""Private pools of fake GPU nodes for one test.

The nodes from nodes.yaml are shared by every test of a run, so a test that needs to know exactly
how much capacity exists (filling it, hitting InsufficientCapacity) makes its own pool: nodes with
a label only its pods select and a taint only its pods tolerate, so no other test's pods land there
and its pods land nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from controlplane import ControlPlane

POOL_KEY = "m3stack.io/test-pool"
# kwok manages the nodes carrying this annotation (see controlplane.start).
KWOK_ANNOTATIONS = {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}


@dataclass(frozen=True)
class NodePool:
    """What a pod spec needs to land on the pool: `nodeSelector` and one toleration."""

    name: str
    node_names: list[str]
    node_selector: dict[str, str] = field(default_factory=dict)
    toleration: dict[str, str] = field(default_factory=dict)


def fake_gpu_node(name: str, pool: str, gpus: int, product: str) -> dict:
    """A kwok-managed Node with `gpus` nvidia.com/gpu and GPU-feature-discovery style labels."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": KWOK_ANNOTATIONS,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                POOL_KEY: pool,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {"taints": [{"key": POOL_KEY, "value": pool, "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def create_pool(plane: ControlPlane, name: str, count: int, gpus: int, product: str) -> NodePool:
    """Creates `count` Ready fake nodes named <name>-<i>; delete_pool removes them."""
    nodes = [fake_gpu_node(f"{name}-{index}", name, gpus, product) for index in range(count)]
    plane.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    plane.kubectl("wait", "--for=condition=Ready", "node", "-l", f"{POOL_KEY}={name}", "--timeout=60s")
    return NodePool(
        name=name,
        node_names=[node["metadata"]["name"] for node in nodes],
        node_selector={POOL_KEY: name},
        toleration={"key": POOL_KEY, "operator": "Equal", "value": name, "effect": "NoSchedule"},
    )


def delete_pool(plane: ControlPlane, pool: NodePool) -> None:
    plane.kubectl("delete", "node", "-l", f"{POOL_KEY}={pool.name}", "--wait=false")
