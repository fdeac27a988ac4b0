"""ServiceMonitors on the real API server: none while the cluster lacks the Prometheus Operator's CRD, one per
M3Deployment once it has it (noticed without a restart), selecting exactly the resource's gateway and engine
Services by port names they have, recreated when deleted, gone with the resource."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from m3d_testkit import Kube, m3deployment, wait_for
from prometheus_crd import service_monitor_crd

CRD = "servicemonitors.monitoring.coreos.com"


@pytest.fixture
def prometheus_operator_crd(k8s_cluster) -> Iterator:
    """Installs the CRD when called (no Prometheus Operator: nothing scrapes here); removed after the test."""

    def install() -> None:
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(service_monitor_crd()))
        k8s_cluster.wait_crd_established(CRD)

    yield install
    k8s_cluster.kubectl("delete", "crd", CRD, "--wait=false", "--ignore-not-found")


def service_monitors(kube: Kube) -> list[dict]:
    return (kube.try_json("get", "servicemonitors") or {"items": []})["items"]


def test_a_service_monitor_per_m3deployment_once_the_crd_exists(prometheus_operator_crd, operator, kube: Kube):
    operator.start(extra_args=("--service-monitor-labels", "release=kps"))
    kube.apply(m3deployment("watched"))
    kube.wait_all_ready("watched")
    assert service_monitors(kube) == [], "no CRD, no ServiceMonitor, and the resource is Ready all the same"

    prometheus_operator_crd()
    monitor = wait_for("the ServiceMonitor", lambda: service_monitors(kube) and service_monitors(kube)[0])
    assert monitor["metadata"]["name"] == "watched-monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    owners = [ref["name"] for ref in monitor["metadata"]["ownerReferences"] if ref.get("controller")]
    assert owners == ["watched"]
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [kube.namespace]}
    selector = ",".join(f"{key}={value}" for key, value in spec["selector"]["matchLabels"].items())
    services = kube.json("get", "services", "-l", selector)["items"]
    assert sorted(s["metadata"]["name"] for s in services) == ["watched-engine", "watched-gateway"]
    ports = {port["name"] for service in services for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in spec["endpoints"]} <= ports
    assert {endpoint["path"] for endpoint in spec["endpoints"]} == {"/metrics"}

    kube("delete", "servicemonitor", "watched-monitoring")
    wait_for("the drift loop to recreate it", lambda: service_monitors(kube))
    kube("delete", "m3deployment", "watched")
    wait_for("the garbage collector to remove it", lambda: not service_monitors(kube))
