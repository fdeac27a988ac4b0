"""Multi-node engines on the real control plane, with the LeaderWorkerSet CRD installed (sigs.k8s.io/lws, built
by tests/k8s/infra/build-lws): the API server validates the rendered LeaderWorkerSet against LWS's own schema,
the operator (chart ServiceAccount token, so its RBAC must cover leaderworkersets) creates, aggregates and
prunes it, and the CRD's CEL rules refuse inconsistent parallelism.

When ``build-lws`` (without ``--crd-only``) has compiled the LWS controller (about 30 minutes on two cores, once
per machine; CI does not wait for it), the controller runs as a host process (webhooks and certificate management
off: kwok's pods need neither) and the groups' pods really appear on the fake GPU nodes, their readiness making
the LWS status the operator aggregates.  Without it, the test writes the LWS status the controller would write,
through the status subresource, and the operator's side is checked the same way.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lws_controller import WEBHOOK_NAMESPACE_LABEL, LwsController
from m3d_testkit import (
    GROUP,
    REPO_ROOT,
    Kube,
    OperatorProcess,
    deployment,
    live_pods,
    m3deployment,
    pod_ready,
    wait_for,
)

pytestmark = pytest.mark.xdist_group(GROUP)

LWS = "leaderworkersets.leaderworkerset.x-k8s.io"
MULTI_NODE = {
    "engine": {
        "replicas": 2,
        "accelerator": {"count": 2},  # 4 pods x 2 GPUs: room on the two fake H200 nodes next to other tests
        "parallelism": {"tensor": 4, "expert": True},
        "multiNode": {"size": 2},
    }
}


@pytest.fixture(scope="module")
def lws_crd(k8s_cluster, tmp_path_factory) -> Iterator[LwsController | None]:
    """The CRD installed; the LWS controller running too when it has been built (else None)."""
    build = subprocess.run([str(REPO_ROOT / "tests/k8s/infra/build-lws"), "--crd-only"], capture_output=True,
                           text=True, check=True, timeout=600)  # fmt: skip
    folder = build.stdout.strip()
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", f"{folder}/share/crds/")
    k8s_cluster.wait_crd_established(LWS)
    binary = Path(folder) / "bin" / "lws-controller"
    if not os.access(binary, os.X_OK):
        yield None
        return
    controller = LwsController(k8s_cluster, binary, tmp_path_factory.mktemp("lws")).start()
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture(scope="module")
def kube(k8s_cluster, chart, lws_crd, tmp_path_factory, request) -> Iterator[Kube]:
    namespace = f"t-multinode-{secrets.token_hex(3)}"
    k8s_cluster.kubectl("create", "namespace", namespace)
    if lws_crd:  # the LWS pod webhook serves this namespace
        k8s_cluster.kubectl("label", "namespace", namespace, f"{WEBHOOK_NAMESPACE_LABEL}=on")
    process = OperatorProcess(k8s_cluster, chart.service_account_kubeconfig, namespace,
                              tmp_path_factory.mktemp("operator") / "operator.log")  # fmt: skip
    failures_before = request.session.testsfailed
    process.start(drift_interval_s=3)
    yield Kube(k8s_cluster, namespace)
    process.stop()
    if request.session.testsfailed > failures_before:
        sys.stderr.write(f"\n--- operator log ---\n{process.log_tail()}\n")
        if lws_crd is not None:
            sys.stderr.write(f"\n--- LWS controller log ---\n{lws_crd.log_tail()}\n")
    k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def _lws(kube: Kube, name: str) -> dict | None:
    return kube.try_json("get", LWS, name)


def _engines(kube: Kube, name: str) -> dict:
    return kube.m3d(name).get("status", {}).get("engine", {})


def test_a_multi_node_engine_is_a_leader_worker_set_whose_groups_make_the_status(kube, lws_crd):
    kube.apply(m3deployment("mn", MULTI_NODE))
    lws = wait_for("the engine LeaderWorkerSet", lambda: _lws(kube, "mn-engine"))
    assert deployment(kube, "mn-engine") is None
    spec = lws["spec"]
    assert (spec["replicas"], spec["startupPolicy"]) == (2, "LeaderCreated")
    group = spec["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    assert str(leader["resources"]["limits"]["nvidia.com/gpu"]) == "2"
    args = " ".join(leader["args"])
    assert "--tensor-parallel 4 --expert-parallel --nnodes 2 --node-rank $(LWS_WORKER_INDEX)" in args
    assert "--master-addr $(LWS_LEADER_ADDRESS) --master-port 29500" in args
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "M3Deployment"
    selector = kube.json("get", "service", "mn-engine")["spec"]["selector"]
    assert selector["m3stack.io/engine-role"] == "leader"
    if lws_crd:  # the real controller: two groups of a leader and a worker, 2 GPUs each, on the fake nodes

        def group_pods() -> list[dict] | None:
            pods = live_pods(kube, "leaderworkerset.sigs.k8s.io/name=mn-engine")
            return pods if len(pods) == 4 and all(map(pod_ready, pods)) else None

        def seen() -> str:
            pods = kube.json("get", "pods")["items"]
            return "; ".join(f"{p['metadata']['name']} {p['status'].get('phase')} {p['metadata'].get('labels')}"
                             for p in pods)  # fmt: skip

        pods = wait_for("4 Ready group pods", group_pods, timeout_s=120, detail=seen)
        assert (
            sorted(p["metadata"]["labels"]["m3stack.io/engine-role"] for p in pods) == ["leader"] * 2 + ["worker"] * 2
        )
        for pod in pods:
            assert pod["spec"]["nodeName"]
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    else:  # what the controller reports once both groups' pods are Ready
        assert _engines(kube, "mn").get("readyReplicas", 0) == 0
        ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
        ready["observedGeneration"] = lws["metadata"]["generation"]
        kube("patch", LWS, "mn-engine", "--subresource=status", "--type=merge", "-p", json.dumps({"status": ready}))

    def statuses() -> str:
        lws_status = (_lws(kube, "mn-engine") or {}).get("status")
        # LWS counts a group ready from its leader pod and its worker StatefulSet's status (kube-controller-manager).
        workers = {s["metadata"]["name"]: s.get("status") for s in kube.json("get", "statefulsets")["items"]}
        return (f"LeaderWorkerSet status {lws_status}; StatefulSets {workers}; "
                f"M3Deployment engine status {_engines(kube, 'mn')}")  # fmt: skip

    wait_for("the engine groups in the M3Deployment status", lambda: _engines(kube, "mn").get("readyReplicas") == 2,
             timeout_s=180, detail=statuses)  # fmt: skip
    assert kube.condition("mn", "EnginesReady")["status"] == "True"
    kube.wait_all_ready("mn")
    header, row = (line.split() for line in kube("get", "m3d", "mn", "-o", "wide").splitlines()[:2])
    columns = dict(zip(header, row, strict=False))  # trailing empty columns print nothing
    assert (columns["ENGINES"], columns["TP"], columns["NODES"]) == ("2", "4", "2"), columns
    kube("delete", "m3deployment", "mn", "--wait=false")  # its GPUs go back to the fake nodes


def test_back_to_one_node_prunes_the_leader_worker_set(kube):
    kube.apply(m3deployment("back", MULTI_NODE))
    wait_for("the engine LeaderWorkerSet", lambda: _lws(kube, "back-engine"))
    single = {"engine": {"accelerator": {"count": 2}, "parallelism": {"tensor": 2}, "multiNode": {"size": 1}}}
    kube.apply(m3deployment("back", single))
    engine = wait_for("the engine Deployment", lambda: deployment(kube, "back-engine"))
    wait_for("the LeaderWorkerSet to go", lambda: _lws(kube, "back-engine") is None or None)
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert "--tensor-parallel" in container["args"] and "--nnodes" not in container["args"]
    kube.wait_all_ready("back")


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"accelerator": {"count": 8}, "parallelism": {"tensor": 8}, "multiNode": {"size": 2}},
         "parallelism.tensor must equal accelerator.count x multiNode.size"),
        ({"accelerator": {"count": 0}, "parallelism": {"tensor": 2}, "multiNode": {"size": 2}},
         "parallelism.tensor must equal accelerator.count x multiNode.size"),
        ({"accelerator": {"count": 4}, "parallelism": {"tensor": 8}}, "parallelism.tensor must not exceed"),
        ({"accelerator": {"count": 8}, "parallelism": {"tensor": 16},
          "multiNode": {"size": 2, "rendezvousPort": 50051}}, "rendezvousPort must differ"),
    ],
)  # fmt: skip
def test_inconsistent_parallelism_is_refused(kube, engine, message):
    manifest = m3deployment(f"bad-{secrets.token_hex(2)}", {"engine": engine})
    kubectl = str(kube.cluster.binary("kubectl"))
    result = kube.cluster.run([kubectl, "-n", kube.namespace, "apply", "-f", "-"], input=json.dumps(manifest),
                              check=False)  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr
