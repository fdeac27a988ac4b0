"""The operator on the real control plane: the chart installed with Helm, the operator process running
with the chart's ServiceAccount token (so missing RBAC fails loudly), pods scheduled on fake GPU
nodes and made Ready by kwok.

One operator serves every test of this module (one namespace, one M3Deployment name per test), so
the suite pays its start-up once; test_restart.py and test_many.py run their own.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator

import pytest
import yaml
from m3d_testkit import (
    EXAMPLE,
    RELEASE_NAMESPACE,
    SERVICE_ACCOUNT,
    Kube,
    OperatorProcess,
    deployment,
    live_pods,
    m3deployment,
    pod_ready,
    wait_for,
)

OPERATOR: OperatorProcess | None = None  # the module's operator, set by the kube fixture


@pytest.fixture(scope="module")
def kube(k8s_cluster, chart, tmp_path_factory, request) -> Iterator[Kube]:
    namespace = f"t-operator-{secrets.token_hex(3)}"
    k8s_cluster.kubectl("create", "namespace", namespace)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(k8s_cluster, chart.service_account_kubeconfig, namespace, log)
    process.start(drift_interval_s=5)
    request.module.OPERATOR = process
    yield Kube(k8s_cluster, namespace)
    process.stop()
    k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


@pytest.fixture(autouse=True)
def operator_log_on_failure(request) -> Iterator[None]:
    """The shared operator's recent log, shown with a test that failed."""
    yield
    report = getattr(request.node, "rep_call", None)
    process = getattr(request.module, "OPERATOR", None)
    if report is not None and report.failed and process is not None:
        sys.stderr.write(f"\n--- operator log ---\n{process.log_tail()}\n")


def test_the_chart_renders_what_the_api_server_accepts(k8s_cluster, chart):
    """helm template | kubectl apply --dry-run=server: schema and admission checks of every object."""
    rendered = k8s_cluster.run(
        [
            str(k8s_cluster.binary("helm")),
            "template",
            "m3stack",
            str(EXAMPLE.parent.parent),
            "--namespace",
            RELEASE_NAMESPACE,
            # The `helm test` hooks are created by `helm test` itself, their ServiceAccount first
            # (test_helm_test.py); a dry run of the Pod alone would find no ServiceAccount.
            "--no-hooks",
        ]
    ).stdout
    k8s_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    operator_deployment = k8s_cluster.kubectl(
        "-n", RELEASE_NAMESPACE, "get", "deployment", SERVICE_ACCOUNT, "-o", "json"
    )
    # Both replicas (one leads, one stands by; under kwok neither runs).
    assert json.loads(operator_deployment)["status"]["readyReplicas"] == 2, "helm install --wait got them Ready"


def test_the_example_becomes_ready_with_owned_children(kube):
    example = yaml.safe_load(EXAMPLE.read_text())
    kube.apply(example)
    body = kube.wait_all_ready("tiny")
    uid = body["metadata"]["uid"]
    assert not body["metadata"].get("finalizers"), "deletion must never wait for the operator"
    children = kube.children("tiny")
    assert sorted((c["kind"], c["metadata"]["name"]) for c in children) == [
        ("ConfigMap", "tiny-config"),
        ("Deployment", "tiny-engine"),
        ("Deployment", "tiny-gateway"),
        ("Ingress", "tiny"),
        ("NetworkPolicy", "tiny-engine"),
        ("PodDisruptionBudget", "tiny-engine"),
        ("PodDisruptionBudget", "tiny-gateway"),
        ("Service", "tiny-engine"),
        ("Service", "tiny-gateway"),
    ]
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("M3Deployment", "tiny", uid, True)
        assert "m3stack-operator" in {field["manager"] for field in child["metadata"]["managedFields"]}
    status = body["status"]
    assert (status["engine"]["readyReplicas"], status["gateway"]["readyReplicas"]) == (1, 2)
    assert status["phase"] == "Ready"
    assert status["url"] == f"http://tiny-gateway.{kube.namespace}.svc:8000/v1"
    engine_pods = live_pods(kube, status["engine"]["selector"])
    assert len(engine_pods) == 1 and pod_ready(engine_pods[0])
    engine = engine_pods[0]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in engine["resources"]["limits"], "the example's tiny model runs on CPU"
    assert engine["resources"]["requests"] == {"cpu": "500m", "memory": "1536Mi"}
    assert engine["args"][engine["args"].index("--device") + 1] == "cpu"
    table = kube("get", "m3d", "tiny")
    assert table.split("\n")[0].split() == ["NAME", "MODEL", "READY", "ENGINES", "DESIRED", "GATEWAYS", "AGE"]
    assert table.split("\n")[1].split()[:6] == ["tiny", "m3-tiny", "True", "1", "1", "2"]
    events = kube.json("get", "events", "--field-selector", "involvedObject.name=tiny,involvedObject.kind=M3Deployment")
    # Ready turns True once an engine and a gateway are: the second gateway may follow after that event.
    ready = [(event["type"], event["reason"]) for event in events["items"] if event["message"].startswith("Ready is")]
    assert ready in ([("Normal", "AllComponentsReady")], [("Normal", "PartiallyReady")]), ready


def test_kubectl_scale_drives_the_engines(kube):
    kube.apply(m3deployment("scaled"))
    kube.wait_all_ready("scaled")
    serving_since = kube.condition("scaled", "Ready")["lastTransitionTime"]
    kube("scale", "m3d/scaled", "--replicas=3")
    wait_for(
        "3 engine replicas", lambda: (deployment(kube, "scaled-engine") or {}).get("spec", {}).get("replicas") == 3
    )
    body = kube.wait_all_ready("scaled")
    assert body["status"]["engine"]["readyReplicas"] == 3
    # It served throughout: the scale-up neither flipped Ready nor raised a warning.
    assert kube.condition("scaled", "Ready")["lastTransitionTime"] == serving_since
    warnings = kube.json("get", "events", "--field-selector", "involvedObject.name=scaled,type=Warning")["items"]
    assert not warnings, warnings
    scale = kube.json("get", "m3d", "scaled", "--subresource=scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert len(live_pods(kube, scale["status"]["selector"])) == 3


def test_a_spec_edit_rolls_out_only_the_changed_tier(kube):
    kube.apply(m3deployment("rolling", {"engine": {"replicas": 2}}))
    kube.wait_all_ready("rolling")
    gateway_pods = {
        pod["metadata"]["name"] for pod in live_pods(kube, "m3stack.io/deployment=rolling,m3stack.io/component=gateway")
    }
    old_hash = deployment(kube, "rolling-engine")["spec"]["template"]["metadata"]["annotations"][
        "m3stack.io/config-hash"
    ]
    kube(
        "patch",
        "m3d",
        "rolling",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": {"drain": {"shutdownTimeoutSeconds": 90}}}}),
    )
    body = kube.wait_all_ready("rolling")
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"] == 2
    engine = deployment(kube, "rolling-engine")
    new_hash = engine["spec"]["template"]["metadata"]["annotations"]["m3stack.io/config-hash"]
    assert new_hash != old_hash
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 15 + 90 + 15

    def rolled() -> bool:
        pods = live_pods(kube, "m3stack.io/deployment=rolling,m3stack.io/component=engine")
        hashes = {pod["metadata"]["annotations"]["m3stack.io/config-hash"] for pod in pods}
        return len(pods) == 2 and hashes == {new_hash} and all(pod_ready(pod) for pod in pods)

    wait_for("the engines to roll to the new template", rolled)
    assert kube.json("get", "configmap", "rolling-config")["data"]["M3STACK_ENGINE_DRAIN_TIMEOUT"] == "90"
    gateway_now = {
        pod["metadata"]["name"] for pod in live_pods(kube, "m3stack.io/deployment=rolling,m3stack.io/component=gateway")
    }
    assert gateway_now == gateway_pods, "an engine setting must not restart the gateways"


def test_deleted_and_edited_children_come_back(kube):
    kube.apply(m3deployment("healing"))
    kube.wait_all_ready("healing")
    before = {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in kube.children("healing")}
    kube("delete", "service", "healing-engine", "--wait=false")
    kube("delete", "deployment", "healing-gateway", "--wait=false")
    kube("delete", "configmap", "healing-config", "--wait=false")

    def recreated() -> bool:
        now = {(c["kind"], c["metadata"]["name"]): c["metadata"]["uid"] for c in kube.children("healing")}
        replaced = [
            key
            for key in (
                ("Service", "healing-engine"),
                ("Deployment", "healing-gateway"),
                ("ConfigMap", "healing-config"),
            )
            if key in now and now[key] != before[key]
        ]
        return now.keys() == before.keys() and len(replaced) == 3

    wait_for("the deleted children to be recreated", recreated)
    # Someone scales the engine Deployment by hand: the drift loop takes the field back.
    kube("scale", "deployment", "healing-engine", "--replicas=4")
    wait_for(
        "the drift loop to restore the engine replicas",
        lambda: (deployment(kube, "healing-engine") or {}).get("spec", {}).get("replicas") == 1,
    )
    kube.wait_all_ready("healing")


def test_suspend_scales_to_zero_and_back(kube):
    kube.apply(m3deployment("sleepy", {"engine": {"replicas": 2}, "gateway": {"replicas": 2}}))
    kube.wait_all_ready("sleepy")
    kube("patch", "m3d", "sleepy", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for("no pods left", lambda: not live_pods(kube, "m3stack.io/deployment=sleepy"))
    wait_for("phase Suspended", lambda: kube.m3d("sleepy").get("status", {}).get("phase") == "Suspended")
    assert kube.condition("sleepy", "Ready")["reason"] == "Suspended"
    assert kube.m3d("sleepy")["spec"]["engine"]["replicas"] == 2, "suspend keeps the desired count"
    kube("patch", "m3d", "sleepy", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    body = kube.wait_all_ready("sleepy")
    assert (body["status"]["engine"]["readyReplicas"], body["status"]["gateway"]["readyReplicas"]) == (2, 2)


def test_unschedulable_engines_report_insufficient_capacity(kube, k8s_node_pool):
    pool = k8s_node_pool(count=1, gpus=2)
    engine = {
        "replicas": 2,
        "accelerator": {"count": 2},
        "nodeSelector": pool.node_selector,
        "tolerations": [pool.toleration],
    }
    kube.apply(m3deployment("crowded", {"engine": engine}))

    # The second engine is reported unschedulable as soon as the scheduler says so, which can be before the
    # first one is Ready: wait for both facts, then for what they make of the resource.  One engine serves, so
    # the resource is Ready (PartiallyReady) and Degraded at once.
    def one_ready_one_unschedulable() -> bool:
        ready = kube.m3d("crowded").get("status", {}).get("engine", {}).get("readyReplicas")
        engines, serving = kube.condition("crowded", "EnginesReady"), kube.condition("crowded", "Ready")
        return (
            ready == 1
            and engines.get("reason") == "InsufficientCapacity"
            and (serving.get("status"), serving.get("reason")) == ("True", "PartiallyReady")
        )

    wait_for("one engine Ready and EnginesReady=False because of InsufficientCapacity", one_ready_one_unschedulable)
    status = kube.m3d("crowded")["status"]
    assert status["phase"] == "Degraded"
    degraded = kube.condition("crowded", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InsufficientCapacity")
    assert "nvidia.com/gpu" in degraded["message"]
    warnings = kube.json("get", "events", "--field-selector", "involvedObject.name=crowded,type=Warning")["items"]
    assert "InsufficientCapacity" in {event["reason"] for event in warnings}
    kube("scale", "m3d/crowded", "--replicas=1")
    kube.wait_all_ready("crowded")
    assert kube.condition("crowded", "Degraded")["status"] == "False"
    # The operator's log tells the same story as the events, for whoever reads the log and not the resource.
    assert OPERATOR is not None
    log = OPERATOR.log_path.read_text()
    assert (
        f"WARNING m3stack.operator.reconcile: {kube.namespace}/crowded: Degraded is True (InsufficientCapacity): "
        in log
    )
    assert f"INFO m3stack.operator.reconcile: {kube.namespace}/crowded: Ready is True (PartiallyReady)" in log


def test_deleting_the_resource_removes_everything(kube):
    kube.apply(
        m3deployment(
            "doomed", {"autoscaling": {"gateway": {"enabled": True}}, "exposure": {"ingress": {"host": "m3.test"}}}
        )
    )
    kube.wait_all_ready("doomed")
    assert {c["kind"] for c in kube.children("doomed")} >= {"HorizontalPodAutoscaler", "Ingress"}
    kube("delete", "m3d", "doomed", "--wait=true", "--timeout=30s")
    wait_for("children to be garbage-collected", lambda: not kube.children("doomed"))
    wait_for(
        "pods to be gone",
        lambda: not kube.json("get", "pods", "-l", "m3stack.io/deployment=doomed")["items"],
    )
    assert not kube.json("get", "replicasets", "-l", "m3stack.io/deployment=doomed")["items"]


def test_children_no_longer_wanted_are_pruned(kube):
    kube.apply(
        m3deployment(
            "pruned", {"autoscaling": {"gateway": {"enabled": True}}, "exposure": {"ingress": {"host": "m3.test"}}}
        )
    )
    kube.wait_all_ready("pruned")
    gateway = deployment(kube, "pruned-gateway")
    assert gateway["spec"]["replicas"] >= 1
    managers = {
        field["manager"]
        for field in gateway["metadata"]["managedFields"]
        if "f:replicas" in json.dumps(field.get("fieldsV1", {}))
    }
    assert "m3stack-operator" not in managers, "the HPA owns the gateway's replicas"
    kube("patch", "m3d", "pruned", "--type=json", "-p", json.dumps([
        {"op": "remove", "path": "/spec/exposure/ingress"},
        {"op": "replace", "path": "/spec/autoscaling/gateway/enabled", "value": False},
        {"op": "add", "path": "/spec/engine/networkPolicy", "value": False},
    ]))  # fmt: skip
    wait_for("the HPA, the Ingress and the NetworkPolicy to be deleted",
             lambda: not kube.children("pruned", "hpa,ingresses,networkpolicies"))  # fmt: skip
    kube.wait_all_ready("pruned")


def test_a_model_too_big_for_its_gpus_is_reported_before_any_engine_loads(kube):
    """BF16 MiniMax-M3 on one engine of 4 H200s (the operator knows the release's 854 GB): Fits=False with the
    figures and a Warning event; the MXFP8 release on the same 4 GPUs fits."""
    engine = {"accelerator": {"count": 4, "product": "NVIDIA-H200"}, "parallelism": {"tensor": 4}, "replicas": 0}
    for name, path in (("m3-bf16", "/models/MiniMax-M3"), ("m3-mxfp8", "/models/MiniMax-M3-MXFP8")):
        kube.apply(m3deployment(name, {"model": {"name": name, "path": path}, "engine": engine}))

    wait_for("Fits reported for both", lambda: all(kube.condition(n, "Fits") for n in ("m3-bf16", "m3-mxfp8")))
    too_big = kube.condition("m3-bf16", "Fits")
    assert (too_big["status"], too_big["reason"]) == ("False", "InsufficientGPUMemory")
    for figure in ("MiniMax-M3 (854 GB) on parallelism.tensor 4 (accelerator.count 4) NVIDIA-H200",
                   "per GPU of 4 x 140.4 GiB", "weights 201.8 GiB", "does not fit"):  # fmt: skip
        assert figure in too_big["message"], too_big["message"]
    fits = kube.condition("m3-mxfp8", "Fits")
    assert (fits["status"], fits["reason"]) == ("True", "ModelFits") and "weights 106.3 GiB" in fits["message"]

    def warned() -> bool:
        events = kube.json("get", "events", "--field-selector", "involvedObject.name=m3-bf16,type=Warning")["items"]
        return "InsufficientGPUMemory" in {event["reason"] for event in events}

    wait_for("a Warning event InsufficientGPUMemory on m3-bf16", warned)
    kube("delete", "m3d", "m3-bf16", "m3-mxfp8", "--wait=false")
