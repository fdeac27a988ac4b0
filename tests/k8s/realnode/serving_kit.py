"""Helpers for the serving tests on the real node: the chart's operator running as a pod, an M3Deployment
of the tiny CPU model behind the Traefik Ingress, requests through that Ingress, and Prometheus pages read
from pod IPs.

Every request goes to an address of the real node's ranges (node_host.ours): the Ingress on the node
address, pod IPs on the CNI bridge.  Nothing here sends traffic anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import node_host
from kubernetes import client, config
from m3d_testkit import CHART, RELEASE, RELEASE_NAMESPACE, Kube, live_pods, pod_ready, wait_for
from prometheus_client.parser import text_string_to_metric_families
from realnode import RealCluster

from m3stack.operator.render.names import COMPONENT_LABEL, DEPLOYMENT_LABEL, ENGINE, GATEWAY

log = logging.getLogger(__name__)
# httpx logs every request at INFO: thousands of lines under load would bury the tests' figures.
logging.getLogger("httpx").setLevel(logging.WARNING)

MODEL = "m3-tiny"
GATEWAY_PORT = 8000
ENGINE_METRICS_PORT = 9400
ENGINE_GRPC_PORT = 50051
# Engine pods sized for two cores shared with the whole node: one torch thread, a small KV cache, and a
# short drain (1 s in the endpoints, then 2 s for running requests) so a deleted engine is gone in seconds.
ENGINE_ARGS = ["--cpu-threads", "1", "--max-num-seqs", "8", "--kv-cache-gb", "0.25", "--max-model-len", "4096"]
SMALL_ENGINE = {
    "replicas": 1,
    "accelerator": {"count": 0},
    "resources": {"requests": {"cpu": "100m", "memory": "768Mi"}, "limits": {"memory": "3Gi"}},
    "shmSize": "64Mi",
    "drain": {"preStopSeconds": 1, "shutdownTimeoutSeconds": 2},
    "extraArgs": ENGINE_ARGS,
}
SMALL_GATEWAY = {
    "replicas": 2,
    "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
}
# An engine loads torch and the tiny model on a busy two-core machine: minutes at worst.
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0


def checked_url(url: str) -> str:
    """The URL, after refusing any host outside the real node's ranges and loopback."""
    host = httpx.URL(url).host
    assert node_host.ours(host), f"{host} is not an address the real node created"
    return url


# ---------------------------------------------------------------------------------------------
# The operator, as the chart runs it


def _split_reference(reference: str) -> tuple[str, str]:
    repository, _, tag = reference.rpartition(":")
    return repository, tag


@contextlib.contextmanager
def chart_operator(cluster: RealCluster) -> Iterator[None]:
    """The chart's operator (its ServiceAccount, RBAC and in-cluster config) as a pod on the real node,
    watching every namespace.  A release that is already installed is used as it is and left installed;
    one installed here (one replica, the images of this tree) is uninstalled afterwards."""
    plane = cluster.plane
    helm = str(plane.binary("helm"))
    status = plane.run([helm, "status", RELEASE, "--namespace", RELEASE_NAMESPACE], check=False)
    if status.returncode == 0:
        log.info("using the installed chart release %s/%s", RELEASE_NAMESPACE, RELEASE)
        yield
        return
    repository, tag = _split_reference(cluster.images["operator"])
    values = {
        "image.repository": repository,
        "image.tag": tag,
        "defaultImages.engine": cluster.images["engine"],
        "defaultImages.gateway": cluster.images["gateway"],
        "replicas": "1",
    }
    started = time.monotonic()
    install = plane.run(
        [helm, "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
         "--wait", "--timeout", "5m", *(f"--set={key}={value}" for key, value in values.items())],
        check=False,
    )  # fmt: skip
    assert install.returncode == 0, f"helm install failed:\n{install.stdout}\n{install.stderr}"
    log.info("chart installed, operator pod Ready, in %.1f s", time.monotonic() - started)
    try:
        yield
    finally:
        plane.run([helm, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait"], check=False)


def operator_pod(cluster: RealCluster) -> dict[str, Any]:
    selector = f"app.kubernetes.io/name=m3stack-operator,app.kubernetes.io/instance={RELEASE}"
    listing = cluster.plane.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-l", selector, "-o", "json")
    pods = json.loads(listing)["items"]
    running = [pod for pod in pods if pod_ready(pod) and not pod["metadata"].get("deletionTimestamp")]
    assert running, f"no Ready operator pod in {RELEASE_NAMESPACE}"
    return running[0]


@contextlib.contextmanager
def module_namespace(cluster: RealCluster, prefix: str) -> Iterator[str]:
    """A namespace for a module's tests, deleted (and waited for) afterwards."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    cluster.plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.plane.kubectl("delete", "namespace", name, "--timeout=180s")


# ---------------------------------------------------------------------------------------------
# The M3Deployment


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        both_dicts = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both_dicts else value
    return merged


def tiny_m3deployment(name: str, images: dict[str, str], host: str, spec: dict[str, Any] | None = None) -> dict:
    """The README's example (the embedded tiny model on CPU, two gateways, an Ingress), with pods sized for
    this node, the images of this tree, and an Ingress host of its own so that modules never share a route."""
    base = {
        "model": {"name": MODEL, "path": "default"},
        "engine": {**SMALL_ENGINE, "image": images["engine"]},
        "gateway": {**SMALL_GATEWAY, "image": images["gateway"]},
        "exposure": {"ingress": {"host": host}},
    }
    return {
        "apiVersion": "m3stack.io/v1alpha1",
        "kind": "M3Deployment",
        "metadata": {"name": name},
        "spec": _merged(base, spec or {}),
    }


@dataclass
class Served:
    """An M3Deployment that serves on the real node, and how to reach its pods."""

    cluster: RealCluster
    kube: Kube
    name: str
    host: str  # the Ingress rule's host
    ready_s: float = 0.0  # apply -> Ready, when this fixture created it

    def selector(self, component: str) -> str:
        return f"{DEPLOYMENT_LABEL}={self.name},{COMPONENT_LABEL}={component}"

    def pods(self, component: str) -> list[dict[str, Any]]:
        return live_pods(self.kube, self.selector(component))

    def ready_pods(self, component: str) -> list[dict[str, Any]]:
        return [pod for pod in self.pods(component) if pod_ready(pod)]

    def wait_engines(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> list[dict[str, Any]]:
        """Until exactly `count` engine pods exist and all are Ready; returns them."""

        def settled() -> list[dict[str, Any]] | None:
            pods = self.pods(ENGINE)
            return pods if len(pods) == count and all(map(pod_ready, pods)) else None

        return wait_for(f"{count} Ready engine pods", settled, timeout_s, interval_s=1.0)

    def gateways_see(self, engine_ips: set[str], timeout_s: float = 120.0) -> None:
        """Until every Ready gateway pod holds exactly these engines, each passing its health checks."""
        wanted = {f"{ip}:{ENGINE_GRPC_PORT}" for ip in engine_ips}

        def seen() -> bool:
            gateways = self.ready_pods(GATEWAY)
            return bool(gateways) and all(ready_engines(pod) == wanted for pod in gateways)

        wait_for(f"every gateway to route to {sorted(wanted)}", seen, timeout_s, interval_s=1.0)

    def url(self) -> str:
        return checked_url(self.cluster.ingress_url)


@contextlib.contextmanager
def served(cluster: RealCluster, namespace: str, name: str, spec: dict[str, Any] | None = None) -> Iterator[Served]:
    """Applies the tiny M3Deployment, waits until it is Ready and answers through the Ingress; deletes it after."""
    host = f"{name}.{namespace}.m3stack.test"
    kube = Kube(cluster.plane, namespace)
    started = time.monotonic()
    kube.apply(tiny_m3deployment(name, cluster.images, host, spec))
    try:
        kube.wait_all_ready(name, timeout_s=READY_TIMEOUT_S)
        stack = Served(cluster, kube, name, host, ready_s=time.monotonic() - started)
        with IngressClient(stack) as ingress:
            wait_for("a chat completion through the Ingress", lambda: ingress.chat().status == 200, timeout_s=120)
        log.info("M3Deployment %s Ready %.1f s after apply", name, stack.ready_s)
        yield stack
    finally:
        kube("delete", "m3deployment", name, "--ignore-not-found", "--wait=true", "--timeout=120s")


@contextlib.contextmanager
def module_deployment(cluster: RealCluster, prefix: str, spec: dict[str, Any] | None = None) -> Iterator[Served]:
    """A module's M3Deployment `tiny` in a namespace of its own, served by the chart's operator pod."""
    with (
        chart_operator(cluster),
        module_namespace(cluster, prefix) as namespace,
        served(cluster, namespace, "tiny", spec) as stack,
    ):
        yield stack


# ---------------------------------------------------------------------------------------------
# Requests through the Ingress


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic()
    seconds: float
    status: int | None  # None: no HTTP answer at all
    detail: str  # the error object's code for an OpenAI error, the first bytes of any other failure

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def from_gateway(self) -> bool:
        """Answered by a gateway: a 200, or an OpenAI error object (the Ingress's own answers are plain text)."""
        return self.ok or self.detail.startswith("openai:")


class IngressClient:
    """Chat completions to one M3Deployment through the Traefik Ingress (its Host rule), over httpx."""

    def __init__(self, stack: Served) -> None:
        self.stack = stack
        self._client = httpx.Client(
            base_url=stack.url(), headers={"Host": stack.host}, timeout=REQUEST_TIMEOUT_S, trust_env=False
        )

    def __enter__(self) -> IngressClient:
        return self

    def __exit__(self, *_: object) -> None:
        self._client.close()

    def chat(self, content: str = "Say something.", max_tokens: int = 8, ignore_eos: bool = False) -> Outcome:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
        }
        started = time.monotonic()
        try:
            response = self._client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            return Outcome(started, time.monotonic() - started, None, f"{type(error).__name__}: {error}")
        return Outcome(started, time.monotonic() - started, response.status_code, _detail(response))


def _detail(response: httpx.Response) -> str:
    if response.status_code == 200:
        return ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = response.json()["error"]
        return f"openai:{error.get('code') or error.get('type')}: {error.get('message', '')[:200]}"
    return response.text[:200]


class SteadyLoad:
    """`workers` threads sending chat completions through the Ingress back to back, so about `workers` requests
    are in flight at any time, recording every outcome."""

    def __init__(self, stack: Served, workers: int = 2, max_tokens: int = 8, ignore_eos: bool = False) -> None:
        self.stack = stack
        self.workers = workers
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> SteadyLoad:
        for index in range(self.workers):
            thread = threading.Thread(target=self._work, args=(index,), name=f"load-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 10)

    def _work(self, index: int) -> None:
        with IngressClient(self.stack) as ingress:
            count = 0
            while not self._stop.is_set():
                count += 1
                prompt = f"Request {count} of worker {index}: say something."
                outcome = ingress.chat(prompt, self.max_tokens, self.ignore_eos)
                with self._lock:
                    self.outcomes.append(outcome)
                if not outcome.ok:
                    time.sleep(0.2)  # a failure comes back at once: do not spin on it

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)


def latency_summary(outcomes: list[Outcome]) -> str:
    seconds = sorted(outcome.seconds for outcome in outcomes if outcome.ok)
    if not seconds:
        return "no successful request"
    p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
    return (
        f"latency p50 {statistics.median(seconds) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, max {seconds[-1] * 1e3:.0f} ms"
    )


# ---------------------------------------------------------------------------------------------
# Metrics, read from pod IPs


Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]


def scrape(pod: dict[str, Any], port: int) -> Samples:
    """The Prometheus page of a pod, by its pod IP."""
    url = checked_url(f"http://{pod['status']['podIP']}:{port}/metrics")
    with httpx.Client(timeout=10, trust_env=False) as http:
        response = http.get(url)
    response.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value for found, value in samples.get(name, []) if all(found.get(key) == want for key, want in labels.items())
    )


def ready_engines(gateway_pod: dict[str, Any]) -> set[str]:
    """The engines (HOST:PORT) a gateway pod routes to right now: its m3stack_gateway_engine_ready series."""
    return {
        labels["engine"]
        for labels, value in scrape(gateway_pod, GATEWAY_PORT).get("m3stack_gateway_engine_ready", [])
        if value == 1
    }


def engine_successes(engine_pod: dict[str, Any]) -> float:
    """Requests this engine pod finished (vLLM's request_success counter, every finish reason)."""
    return total(scrape(engine_pod, ENGINE_METRICS_PORT), "vllm:request_success_total")


def gateway_failures(gateway_pod: dict[str, Any]) -> dict[str, float]:
    """Non-2xx API answers a gateway pod sent, by status code."""
    failures: dict[str, float] = {}
    for labels, value in scrape(gateway_pod, GATEWAY_PORT).get("m3stack_gateway_requests_total", []):
        if not labels.get("status", "").startswith("2") and value:
            failures[labels["status"]] = failures.get(labels["status"], 0.0) + value
    return failures


# ---------------------------------------------------------------------------------------------
# What the API server says, polled in the background


@dataclass
class Timeline:
    """When things first became true, polled every `interval_s` with the Python client (cheaper than kubectl)."""

    probes: dict[str, Callable[[], bool]]
    interval_s: float = 0.25
    first: dict[str, float] = field(default_factory=dict)  # name -> time.monotonic() first seen true
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Timeline:
        self._thread = threading.Thread(target=self._poll, name="timeline", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _poll(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for name, probe in self.probes.items():
                if name not in self.first:
                    with contextlib.suppress(client.ApiException):
                        if probe():
                            self.first[name] = now
            self._stop.wait(self.interval_s)


def api_client(cluster: RealCluster) -> client.ApiClient:
    return config.new_client_from_config(str(cluster.plane.kubeconfig))


def ready_endpoints(api: client.ApiClient, namespace: str, service: str) -> list[str]:
    """Addresses of the Service's EndpointSlices that are ready: what Traefik and kube-proxy route to."""
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={service}"
    )
    return [
        address
        for endpoint_slice in slices.items
        for endpoint in endpoint_slice.endpoints or []
        if endpoint.conditions is not None and endpoint.conditions.ready
        for address in endpoint.addresses
    ]


def ready_pod_count(api: client.ApiClient, namespace: str, selector: str) -> int:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    return sum(
        1
        for pod in pods
        if pod.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    )
