"""Parallelism and multi-node engines in rendering and status (pure; the real control plane is in tests/k8s).

Rendered command lines are parsed by the real ``m3stack`` parser, after the kubelet's ``$(VAR)`` expansion of
the variables LeaderWorkerSet sets, so a flag renamed in the engine fails here, not in a pod.
"""

import pytest

from m3stack.cli import build_parser
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.operator.render import render_children
from m3stack.operator.render.multinode import ENGINE_ROLE_LABEL, workload_view
from m3stack.operator.render.names import COMPONENT_LABEL
from m3stack.operator.status import ENGINES_READY, Observed, compute_status

SINGLE_NODE = {"engine": {"accelerator": {"count": 4}, "parallelism": {"tensor": 4, "expert": True}}}
MULTI_NODE = {
    "engine": {
        "replicas": 3,
        "accelerator": {"count": 8, "product": "NVIDIA-H200"},
        "parallelism": {"tensor": 16},
        "multiNode": {"size": 2, "rendezvousPort": 29511},
    }
}


def _children(make_m3d, images, spec) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render_children(make_m3d(spec), images)}


def _engine_config(args: list[str], worker_index: int, leader: str):
    """What the engine process builds from its rendered command line, in group position ``worker_index``."""
    expanded = [a.replace("$(LWS_WORKER_INDEX)", str(worker_index)).replace("$(LWS_LEADER_ADDRESS)", leader)
                for a in args]  # fmt: skip
    parsed = build_parser().parse_args(expanded)
    return ParallelConfig(tensor_parallel=parsed.tensor_parallel, expert_parallel=parsed.expert_parallel,
                          nnodes=parsed.nnodes, node_rank=parsed.node_rank, master_addr=parsed.master_addr,
                          master_port=parsed.master_port)  # fmt: skip


def test_parallelism_renders_the_gpu_count_and_the_engine_flags(make_m3d, images):
    children = _children(make_m3d, images, SINGLE_NODE)
    (container,) = children[("Deployment", "demo-engine")]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    parallel = _engine_config(container["args"], 0, "unused")
    assert parallel == ParallelConfig(tensor_parallel=4, expert_parallel=True)
    assert ("LeaderWorkerSet", "demo-engine") not in children


def test_one_gpu_renders_no_parallel_flags(make_m3d, images):
    children = _children(make_m3d, images, {})
    (container,) = children[("Deployment", "demo-engine")]["spec"]["template"]["spec"]["containers"]
    assert not {"--tensor-parallel", "--expert-parallel", "--nnodes"} & set(container["args"])


def test_multi_node_renders_a_leader_worker_set(make_m3d, images):
    children = _children(make_m3d, images, MULTI_NODE)
    assert ("Deployment", "demo-engine") not in children
    assert ("Deployment", "demo-gateway") in children
    lws = children[("LeaderWorkerSet", "demo-engine")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 3
    assert spec["startupPolicy"] == "LeaderCreated"  # a leader is Ready only once every worker joined it
    assert spec["rolloutStrategy"] == {"type": "RollingUpdate",
                                       "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}}  # fmt: skip
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    for container in (leader, worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert group["leaderTemplate"]["metadata"]["labels"][ENGINE_ROLE_LABEL] == "leader"
    assert group["workerTemplate"]["metadata"]["labels"][ENGINE_ROLE_LABEL] == "worker"
    assert group["workerTemplate"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(worker)
    assert {p["name"] for p in leader["ports"]} == {"grpc", "metrics", "rendezvous"}
    # The same pod template hash on both roles: a config change rolls whole groups.
    annotations = [group[t]["metadata"]["annotations"] for t in ("leaderTemplate", "workerTemplate")]
    assert annotations[0] == annotations[1]
    leader_address = "demo-engine-1.demo-engine.models"
    for index, container in enumerate((leader, worker)):
        parallel = _engine_config(container["args"], index, leader_address)
        assert parallel == ParallelConfig(tensor_parallel=16, nnodes=2, node_rank=index, master_addr=leader_address,
                                          master_port=29511)  # fmt: skip
        assert parallel.first_rank == 8 * index


def test_the_engine_service_selects_group_leaders_only(make_m3d, images):
    service = _children(make_m3d, images, MULTI_NODE)[("Service", "demo-engine")]
    assert service["spec"]["selector"][ENGINE_ROLE_LABEL] == "leader"
    assert service["spec"]["selector"][COMPONENT_LABEL] == "engine"
    single = _children(make_m3d, images, SINGLE_NODE)[("Service", "demo-engine")]
    assert ENGINE_ROLE_LABEL not in single["spec"]["selector"]


def test_suspend_scales_the_groups_to_zero(make_m3d, images):
    spec = {**MULTI_NODE, "suspend": True}
    assert _children(make_m3d, images, spec)[("LeaderWorkerSet", "demo-engine")]["spec"]["replicas"] == 0


def _lws_with_status(make_m3d, images, status: dict) -> dict:
    lws = _children(make_m3d, images, MULTI_NODE)[("LeaderWorkerSet", "demo-engine")]
    lws["metadata"]["generation"] = 2
    return {**lws, "status": {"observedGeneration": 2, **status}}


def _gateway(make_m3d, images) -> dict:
    gateway = _children(make_m3d, images, MULTI_NODE)[("Deployment", "demo-gateway")]
    gateway["metadata"]["generation"] = 1
    count = gateway["spec"]["replicas"]
    ready = {
        "observedGeneration": 1,
        **dict.fromkeys(("replicas", "readyReplicas", "updatedReplicas", "availableReplicas"), count),
    }
    return {**gateway, "status": ready}


@pytest.mark.parametrize(
    ("ready_groups", "engines_ready", "ready_reason"), [(3, True, "AllComponentsReady"), (2, False, "PartiallyReady")]
)
def test_status_counts_ready_groups(make_m3d, images, ready_groups, engines_ready, ready_reason):
    m3d = make_m3d(MULTI_NODE)
    lws = _lws_with_status(make_m3d, images, {"replicas": 3, "readyReplicas": ready_groups, "updatedReplicas": 3})
    observed = Observed(deployments={"engine": workload_view(lws), "gateway": _gateway(make_m3d, images)})
    status, _ = compute_status(m3d, observed, {}, observed_generation=3, now="2026-11-30T00:00:00Z")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions[ENGINES_READY]["status"] == ("True" if engines_ready else "False")
    assert status["engine"]["readyReplicas"] == ready_groups
    assert status["engine"]["availableReplicas"] == ready_groups
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", ready_reason)
    assert status["phase"] == "Ready", "two ready groups of three serve"
