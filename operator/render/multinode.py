"""Engines over several nodes: one LeaderWorkerSet group of ``multiNode.size`` pods per engine replica.

The pods of a group are the single-node engine pod (same image, volumes, GPUs, scheduling, config hash), told
which node they are: ``--node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)``, variables LWS
puts into every container of a group.  The leader (index 0) runs the scheduler and the gRPC server and keeps
the engine's probes and ports; workers only serve their GPUs' ranks, so they have no gRPC port and no probes,
and the engine Service selects leaders only.

GPU-minded group policies:

* ``startupPolicy: LeaderCreated``: workers start with the leader.  The leader becomes Ready only after loading
  its shard, which needs every rank to have joined it: waiting for a Ready leader (LeaderReady) would never end.
* ``restartPolicy: RecreateGroupOnPodRestart``: a NCCL group does not survive losing a member, so any pod's
  failure restarts the whole group.
* rollout ``maxUnavailable: 1, maxSurge: 0``: one group at a time, never a surge group's worth of extra GPUs.
"""

import copy
from collections.abc import Mapping
from typing import Any

from m3stack.operator.crd import GROUP
from m3stack.operator.render.engine import GRPC_PORT_NAME, METRICS_PORT_NAME, engine_deployment
from m3stack.operator.render.names import ENGINE, child_metadata
from m3stack.operator.spec import M3Deployment

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
ENGINE_ROLE_LABEL = f"{GROUP}/engine-role"
LEADER = "leader"
WORKER = "worker"
RENDEZVOUS_PORT_NAME = "rendezvous"
# Only the leader serves: these leave the worker template.
LEADER_ONLY_CONTAINER_FIELDS = ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle")


def is_multi_node(m3d: M3Deployment) -> bool:
    return m3d.spec.engine.multi_node.size > 1


def _role_template(template: Mapping[str, Any], role: str, rendezvous_port: int) -> dict[str, Any]:
    out = copy.deepcopy(dict(template))
    out["metadata"]["labels"][ENGINE_ROLE_LABEL] = role
    container = out["spec"]["containers"][0]
    if role == LEADER:
        container["ports"].append({"name": RENDEZVOUS_PORT_NAME, "containerPort": rendezvous_port, "protocol": "TCP"})
    else:
        for field in LEADER_ONLY_CONTAINER_FIELDS:
            container.pop(field, None)
        container["ports"] = [p for p in container["ports"] if p["name"] not in (GRPC_PORT_NAME, METRICS_PORT_NAME)]
        if not container["ports"]:
            del container["ports"]
    return out


def engine_leader_worker_set(m3d: M3Deployment, image: str, config_hash: str) -> dict[str, Any]:
    """The engine tier of a multi-node resource: ``engine.replicas`` groups of ``multiNode.size`` pods."""
    engine = m3d.spec.engine
    template = engine_deployment(m3d, image, config_hash)["spec"]["template"]
    port = engine.multi_node.rendezvous_port
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": child_metadata(m3d, ENGINE),
        "spec": {
            "replicas": 0 if m3d.spec.suspend else engine.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": engine.multi_node.size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _role_template(template, LEADER, port),
                "workerTemplate": _role_template(template, WORKER, port),
            },
        },
    }


def leaders_only(service: dict[str, Any]) -> dict[str, Any]:
    """The engine Service of a multi-node resource: gateways connect to group leaders only."""
    out = copy.deepcopy(service)
    out["spec"]["selector"][ENGINE_ROLE_LABEL] = LEADER
    return out


def workload_view(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Deployment, or a LeaderWorkerSet shaped like one for the status code: replicas and their counts are
    groups (a group is ready when all its pods are), availability is readiness."""
    if workload.get("kind") != LWS_KIND:
        return workload
    status = dict(workload.get("status", {}))
    status.setdefault("availableReplicas", status.get("readyReplicas", 0))
    return {**workload, "status": status}
