"""Smoke test of the test control plane: fake GPU nodes, and the real Deployment -> ReplicaSet ->
Pod -> scheduled -> Ready path, Services with EndpointSlices and garbage collection on top of them."""

from __future__ import annotations

import ipaddress
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import pytest
import yaml
from controlplane import FAKE_NODES, NODES_MANIFEST, ControlPlane
from kubernetes import client

GPU = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
# Pods are never pulled or run: kwok only moves them through their phases.
IMAGE = "registry.invalid/m3stack/smoke:0"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 60.0) -> T:
    """Polls probe() until it returns something truthy, and returns that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


def gpu_deployment(name: str, replicas: int, gpus: int, node_selector: dict, tolerations: list | None = None) -> dict:
    labels = {"app": name}
    container = {
        "name": "engine",
        "image": IMAGE,
        "ports": [{"name": "grpc", "containerPort": 50051}],
        "resources": {"limits": {GPU: str(gpus)}, "requests": {"cpu": "1", "memory": "1Gi"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"nodeSelector": node_selector, "tolerations": tolerations or [], "containers": [container]},
            },
        },
    }


def manifest_nodes() -> list[dict]:
    return yaml.safe_load(NODES_MANIFEST.read_text())["items"]


def is_ready(conditions: list | None) -> bool:
    return any(condition.type == "Ready" and condition.status == "True" for condition in conditions or [])


def test_fake_gpu_nodes_match_their_manifest(k8s_cluster: ControlPlane, k8s_client: Callable) -> None:
    core = client.CoreV1Api(k8s_client())
    expected = manifest_nodes()
    products = {node["metadata"]["labels"].get(PRODUCT_LABEL) for node in expected}
    assert {"NVIDIA-H200", "NVIDIA-B200"} <= products
    for node in expected:
        live = core.read_node(node["metadata"]["name"])
        assert is_ready(live.status.conditions), live.status.conditions
        assert node["metadata"]["labels"].items() <= live.metadata.labels.items()
        for resource in ("cpu", "memory", "pods", GPU):
            wanted = node["status"]["allocatable"].get(resource)
            assert live.status.allocatable.get(resource) == wanted, resource


def test_gpu_deployment_becomes_ready_with_endpoints_and_is_garbage_collected(
    k8s_client: Callable, k8s_namespace: str
) -> None:
    api = k8s_client()
    core, apps, discovery = client.CoreV1Api(api), client.AppsV1Api(api), client.DiscoveryV1Api(api)
    b200_nodes = {node["metadata"]["name"] for node in manifest_nodes()
                  if node["metadata"]["labels"].get(PRODUCT_LABEL) == "NVIDIA-B200"}  # fmt: skip
    replicas = 3
    apps.create_namespaced_deployment(
        k8s_namespace, gpu_deployment("engine", replicas, 1, {PRODUCT_LABEL: "NVIDIA-B200"})
    )
    core.create_namespaced_service(
        k8s_namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "engine"},
            "spec": {"selector": {"app": "engine"}, "ports": [{"name": "grpc", "port": 50051, "targetPort": "grpc"}]},
        },
    )

    wait_for(
        "the Deployment to have all replicas available",
        lambda: (
            (apps.read_namespaced_deployment_status("engine", k8s_namespace).status.available_replicas or 0) == replicas
        ),
    )
    pods = core.list_namespaced_pod(k8s_namespace, label_selector="app=engine").items
    assert len(pods) == replicas
    pod_network = ipaddress.ip_network(FAKE_NODES.pod_cidr)
    for pod in pods:
        assert pod.spec.node_name in b200_nodes, pod.spec.node_name
        assert pod.status.phase == "Running"
        assert is_ready(pod.status.conditions)
        assert ipaddress.ip_address(pod.status.pod_ip) in pod_network
    pod_ips = {pod.status.pod_ip for pod in pods}
    assert len(pod_ips) == replicas

    def ready_endpoint_ips() -> set[str]:
        slices = discovery.list_namespaced_endpoint_slice(
            k8s_namespace, label_selector="kubernetes.io/service-name=engine"
        ).items
        return {
            address
            for endpoint_slice in slices
            for endpoint in endpoint_slice.endpoints or []
            if endpoint.conditions.ready
            for address in endpoint.addresses
        }

    wait_for("the Service's EndpointSlice to list every pod", lambda: ready_endpoint_ips() == pod_ips)

    apps.delete_namespaced_deployment("engine", k8s_namespace, propagation_policy="Background")
    wait_for(
        "the garbage collector to remove the ReplicaSet and its Pods",
        lambda: (
            not apps.list_namespaced_replica_set(k8s_namespace).items
            and not core.list_namespaced_pod(k8s_namespace, label_selector="app=engine").items
        ),
    )
    wait_for("the EndpointSlice to empty", lambda: not ready_endpoint_ips())


def test_scheduler_counts_gpus_on_fake_nodes(k8s_client: Callable, k8s_namespace: str, k8s_node_pool: Callable) -> None:
    """One 8-GPU node fits two 4-GPU pods; the third stays Pending as Unschedulable for GPUs."""
    pool = k8s_node_pool(count=1, gpus=8, product="NVIDIA-H200")
    api = k8s_client()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_deployment(k8s_namespace, gpu_deployment("big", 3, 4, pool.node_selector, [pool.toleration]))

    def placement() -> tuple[Counter, list] | None:
        pods = core.list_namespaced_pod(k8s_namespace, label_selector="app=big").items
        ready = Counter(pod.spec.node_name for pod in pods if is_ready(pod.status.conditions))
        unschedulable = [
            condition
            for pod in pods
            for condition in pod.status.conditions or []
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable"
        ]
        return (ready, unschedulable) if sum(ready.values()) == 2 and unschedulable else None

    ready, unschedulable = wait_for("two pods Ready and one Unschedulable", placement)
    assert ready == Counter({pool.node_names[0]: 2})
    assert len(unschedulable) == 1
    assert f"Insufficient {GPU}" in unschedulable[0].message


def test_helm_test_hook_pods_succeed_and_other_pods_keep_running(k8s_client: Callable, k8s_namespace: str) -> None:
    """infra/stages/helm-test-pods.yaml: `helm test` can pass here; ordinary pods are unaffected."""
    core = client.CoreV1Api(k8s_client())
    spec = {"nodeSelector": {"kubernetes.io/hostname": "cpu-0"}, "containers": [{"name": "check", "image": IMAGE}]}
    for name, pod_annotations in (("hook", {"helm.sh/hook": "test"}), ("plain", {})):
        core.create_namespaced_pod(
            k8s_namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "annotations": pod_annotations},
                "spec": spec,
            },
        )

    def phases() -> dict[str, str]:
        return {name: core.read_namespaced_pod(name, k8s_namespace).status.phase for name in ("hook", "plain")}

    # The two pods are scheduled and started independently: the hook pod may finish before the plain one runs.
    wait_for("the hook pod to succeed and the plain one to run",
             lambda: phases() == {"hook": "Succeeded", "plain": "Running"})  # fmt: skip
    hook_status = core.read_namespaced_pod("hook", k8s_namespace).status.container_statuses[0]
    assert hook_status.state.terminated.exit_code == 0
