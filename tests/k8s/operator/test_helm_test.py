"""`helm test` on the real API server: the chart's hook pod (``m3stack probe --discover``) is created with a
read-only ServiceAccount, and `helm test` waits for it to succeed.  kwok completes pods without running them
(infra/stages/helm-test-pods.yaml): the probe's own behaviour against real gateways is tested as a process
(tests/observability/test_probe.py), and a real kubelet node runs the hook for real.  Discovery, the part that
talks to the API server, runs here against it (it computes gateway addresses; nothing connects to them)."""

from __future__ import annotations

from m3d_testkit import RELEASE, RELEASE_NAMESPACE, Kube, m3deployment

from m3stack.cli import build_parser
from m3stack.operator.apply import Cluster
from m3stack.probe import discover


def test_helm_test_runs_the_gateway_probe_pod(k8s_cluster, chart):
    result = k8s_cluster.run(
        [str(k8s_cluster.binary("helm")), "test", RELEASE, "--namespace", RELEASE_NAMESPACE, "--timeout", "2m"],
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "m3stack-test-gateways" in result.stdout and "Succeeded" in result.stdout
    # The hook's objects are gone once it succeeded; the pod ran the probe as the chart renders it.
    assert "m3stack-test-gateways" not in k8s_cluster.kubectl("-n", RELEASE_NAMESPACE, "get", "pods", "-o", "name")
    manifest = k8s_cluster.run(
        [str(k8s_cluster.binary("helm")), "get", "hooks", RELEASE, "--namespace", RELEASE_NAMESPACE]
    ).stdout
    assert "- probe" in manifest and "- --discover" in manifest and "verbs: [list]" in manifest


def test_discovery_finds_each_gateway_service(k8s_client, kube: Kube):
    for name in ("first", "second"):
        kube.apply(m3deployment(name, {"gateway": {"port": 8123}} if name == "second" else None))
    found = {gateway.name: gateway.base_url for gateway in discover((kube.namespace,), Cluster(k8s_client()))}
    assert found == {
        f"{kube.namespace}/first": f"http://first-gateway.{kube.namespace}.svc:8000/v1",
        f"{kube.namespace}/second": f"http://second-gateway.{kube.namespace}.svc:8123/v1",
    }
    args = build_parser().parse_args(["probe", "--discover", "--namespace", kube.namespace])
    assert args.discover and args.namespace == (kube.namespace,)
