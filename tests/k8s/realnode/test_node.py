"""The real node itself: it joins with node credentials, runs pods that serve, and gives them Services,
cluster DNS, the API through the `kubernetes` Service, and kubectl logs / exec / port-forward."""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import subprocess
import time
import urllib.request

import node_host
from m3d_testkit import Kube, live_pods, pod_ready, wait_for
from realnode import RealCluster

log = logging.getLogger(__name__)

WEB_PORT = 8080


def _get(url: str) -> tuple[int, bytes, float]:
    """GET a URL on an address of this test's cluster (refuses any other); status, body, seconds."""
    host = url.split("/")[2].rsplit(":", 1)[0]
    assert node_host.ours(host), f"{host} is not an address the real node created"
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read(), time.monotonic() - started


def _until_served(url: str, timeout_s: float = 60.0) -> float:
    """Polls url until it answers; returns the time.monotonic() of the first answer."""

    def answered() -> float | None:
        try:
            _get(url)
        except OSError:  # URLError and refused connections alike
            return None
        return time.monotonic()

    return wait_for(f"{url} to answer", answered, timeout_s)


def _web_server(kube: Kube, image: str) -> dict:
    """A Deployment serving files over HTTP from the operator image, and its Service."""
    labels = {"app": "web"}
    container = {
        "name": "web",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "http.server", str(WEB_PORT), "--directory", "/opt/m3stack/share"],
        "ports": [{"containerPort": WEB_PORT, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/constraints.txt", "port": WEB_PORT}, "periodSeconds": 1},
        "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
    }
    kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                # python as PID 1 ignores SIGTERM: without a short grace the namespace's deletion waits 30 s.
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [container], "terminationGracePeriodSeconds": 1},
                },
            },
        }
    )
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": WEB_PORT, "name": "http"}]},
        }
    )
    pods = wait_for("the web pod to be Ready", lambda: [p for p in live_pods(kube, "app=web") if pod_ready(p)])
    return pods[0]


# Runs inside a pod: what a workload sees of DNS, Services and the API server.
CLIENT_SCRIPT = """
import json, os, socket, urllib.request
from kubernetes import client, config
namespace = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
result = {"resolv_conf": open("/etc/resolv.conf").read(), "routes": open("/proc/net/route").read().splitlines()[1:]}
result["web_address"] = socket.gethostbyname(f"web.{namespace}.svc.cluster.local")
with urllib.request.urlopen("http://web/constraints.txt", timeout=10) as response:
    result["web_by_short_name"] = response.status
try:
    socket.getaddrinfo("example.com", 443)
    result["outside_name"] = "resolved"
except socket.gaierror as error:
    result["outside_name"] = f"not resolved: {error}"
config.load_incluster_config()
result["api_host"] = os.environ["KUBERNETES_SERVICE_HOST"]
result["api_version"] = client.VersionApi().get_code().git_version
print(json.dumps(result))
"""


def _run_client(kube: Kube, image: str) -> dict:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "client",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python3", "-c", CLIENT_SCRIPT],
                        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                    }
                ],
            },
        }
    )

    def finished() -> str | None:
        phase = kube.json("get", "pod", "client")["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("the client pod to finish", finished)
    output = kube("logs", "client")
    assert phase == "Succeeded", f"the client pod failed:\n{output}"
    return json.loads(output.strip().splitlines()[-1])


def test_node_joins_with_node_credentials(k8s_real_cluster: RealCluster) -> None:
    plane = k8s_real_cluster.plane
    node = json.loads(plane.kubectl("get", "node", k8s_real_cluster.node_name, "-o", "json"))
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    info = node["status"]["nodeInfo"]
    log.info(
        "node %s: %s, kubelet %s, %s",
        node["metadata"]["name"],
        addresses,
        info["kubeletVersion"],
        info["containerRuntimeVersion"],
    )
    assert addresses["InternalIP"] == node_host.NODE_IP
    assert node["spec"]["podCIDR"] == node_host.NODE_POD_CIDR
    assert info["kubeletVersion"] == "v1.36.3"
    assert info["containerRuntimeVersion"].startswith("containerd://1.6.")
    # The only node: nothing the tests create can land on a fake one.
    assert plane.kubectl("get", "nodes", "-o", "name").split() == [f"node/{k8s_real_cluster.node_name}"]

    # The kubelet is system:node:<name> in system:nodes, limited by the Node authorizer.
    kubelet = k8s_real_cluster.run_dir / "kubelet.kubeconfig"
    whoami = json.loads(plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubelet))
    assert whoami["status"]["userInfo"]["username"] == f"system:node:{k8s_real_cluster.node_name}"
    assert "system:nodes" in whoami["status"]["userInfo"]["groups"]
    assert (
        plane.kubectl("auth", "can-i", "get", f"node/{k8s_real_cluster.node_name}", kubeconfig=kubelet).strip() == "yes"
    )
    denied = plane.run(
        [str(plane.binary("kubectl")), "auth", "can-i", "list", "secrets", "--all-namespaces"],
        kubeconfig=kubelet,
        check=False,
    )
    assert denied.stdout.startswith("no")  # "no - can only read namespaced object of this type"


def test_pod_serves_through_service_dns_and_api(k8s_real_cluster: RealCluster, real_kube: Kube) -> None:
    image = k8s_real_cluster.images["operator"]
    started = time.monotonic()
    pod = _web_server(real_kube, image)
    ready_s = time.monotonic() - started
    pod_ip = pod["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(node_host.NODE_POD_CIDR)
    cluster_ip = real_kube.json("get", "service", "web")["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(node_host.SERVICE_CIDR)

    status, body, by_pod_s = _get(f"http://{pod_ip}:{WEB_PORT}/constraints.txt")
    assert status == 200 and body
    # kube-proxy rewrites its rules after the EndpointSlice names the Ready pod; until then the ClusterIP
    # rejects connections (its no-endpoints rule), so the first answer shows the propagation delay.
    propagated_s = _until_served(f"http://{cluster_ip}/constraints.txt") - started - ready_s
    status, body_by_service, by_service_s = _get(f"http://{cluster_ip}/constraints.txt")
    assert (status, body_by_service) == (200, body)

    seen = _run_client(real_kube, image)
    log.info(
        "web pod Ready %.1f s after apply, its ClusterIP served %.1f s later; GET by pod IP %.1f ms, "
        "by ClusterIP (kube-proxy) %.1f ms; in-pod: %s",
        ready_s, propagated_s, by_pod_s * 1e3, by_service_s * 1e3, {k: v for k, v in seen.items() if k != "routes"},
    )  # fmt: skip
    assert seen["web_address"] == cluster_ip  # CoreDNS answers the Service name
    assert seen["web_by_short_name"] == 200  # through the namespace's search path
    assert f"nameserver {node_host.DNS_SERVICE_IP}" in seen["resolv_conf"]
    assert seen["outside_name"].startswith("not resolved")  # the cluster DNS forwards nothing off the machine
    assert seen["api_host"] == node_host.KUBERNETES_SERVICE_IP
    assert seen["api_version"] == "v1.36.3"  # in-cluster config through the `kubernetes` Service
    destinations = {line.split()[1] for line in seen["routes"]}
    assert "00000000" not in destinations, "pods must have no default route"


def test_logs_exec_and_port_forward(k8s_real_cluster: RealCluster, real_kube: Kube) -> None:
    pod = _web_server(real_kube, k8s_real_cluster.images["operator"])
    name = pod["metadata"]["name"]
    _get(f"http://{pod['status']['podIP']}:{WEB_PORT}/constraints.txt")
    # logs and exec go from the API server to the kubelet's API on the node address, TLS both ways.
    wait_for("the request in the pod's log", lambda: "GET /constraints.txt" in real_kube("logs", name))
    assert real_kube("exec", name, "--", "cat", "/etc/hostname").strip() == name
    local_port = _free_local_port()
    forward = subprocess.Popen(
        [str(k8s_real_cluster.plane.binary("kubectl")), "-n", real_kube.namespace, "port-forward", f"pod/{name}",
         f"{local_port}:{WEB_PORT}", "--address", "127.0.0.1"],
        env=k8s_real_cluster.plane.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert forward.stdout is not None
        assert "Forwarding from" in forward.stdout.readline()
        with urllib.request.urlopen(f"http://127.0.0.1:{local_port}/constraints.txt", timeout=10) as response:
            assert response.status == 200
    finally:
        forward.terminate()
        forward.wait(10)


def _free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
