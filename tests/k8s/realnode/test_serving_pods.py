"""What only real pods can show (#27 item 4): readiness gating, `kubectl scale`, an engine pod deleted under
a stream, a rolling update of the gateways under load, and the engines' NetworkPolicy against the pods it
must select.

One M3Deployment (the README's tiny CPU example, two gateways, an Ingress host of its own) serves the whole
module, created by the chart's operator running as a pod; the tests run in file order and each first puts
the engine count it needs.  Requests go through the Traefik Ingress on the node address; the pods' own
Prometheus pages are read from their pod IPs.  Each test logs its figures (time to Ready, requests lost,
latency); run with `--log-cli-level=INFO` to see them.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from m3d_testkit import wait_for
from realnode import RealCluster
from serving_kit import (
    ENGINE_GRPC_PORT,
    GATEWAY_PORT,
    MODEL,
    READY_TIMEOUT_S,
    IngressClient,
    Served,
    SteadyLoad,
    Timeline,
    api_client,
    engine_successes,
    gateway_failures,
    latency_summary,
    module_deployment,
    ready_endpoints,
    ready_pod_count,
    scrape,
)

from m3stack.operator.render.names import ENGINE, GATEWAY

log = logging.getLogger(__name__)

# Least-inflight routing, so that back-to-back requests alternate between engines: prefix-aware routing (the
# default) would rightly keep every request on the engine that holds the shared chat template's prefix.
SPEC = {"gateway": {"routing": {"policy": "LeastInflight"}}}
STREAM_TOKENS = 4000  # far longer than the engine's 3 s of drain: the stream is cut, not finished


@pytest.fixture(scope="module")
def stack(k8s_real_cluster: RealCluster) -> Iterator[Served]:
    with module_deployment(k8s_real_cluster, "serving", SPEC) as stack:
        yield stack


def _scale(stack: Served, replicas: int) -> None:
    """The issue's command: the M3Deployment's /scale subresource, by its short name."""
    stack.kube("scale", f"m3d/{stack.name}", f"--replicas={replicas}")


def _openai(stack: Served) -> openai.OpenAI:
    """The real OpenAI client, through the Ingress (its Host rule), with no retries of its own."""
    return openai.OpenAI(
        base_url=f"{stack.url()}/v1",
        api_key="unused",
        default_headers={"Host": stack.host},
        http_client=httpx.Client(trust_env=False, timeout=120),
        max_retries=0,
    )


def test_readiness_gates_traffic(stack: Served) -> None:
    """With no engine the gateways leave their Service and the Ingress has no backend; when an engine
    loads, the gateways become Ready only after it, and no request reaching a gateway fails."""
    api = api_client(stack.cluster)
    namespace, gateway_service = stack.kube.namespace, f"{stack.name}-gateway"
    _scale(stack, 0)
    wait_for("the engine pods to be gone", lambda: not stack.pods(ENGINE), timeout_s=120)
    wait_for("no ready gateway endpoint", lambda: not ready_endpoints(api, namespace, gateway_service), timeout_s=60)
    # Traefik follows the EndpointSlices a moment later (its provider throttles updates): until it answers a
    # request itself, requests still reach the gateways that just left (and get their 503).
    with IngressClient(stack) as ingress:
        wait_for("the Ingress to stop routing to the gateways", lambda: not ingress.chat().from_gateway, 60, 0.5)
    gateways = {pod["metadata"]["name"]: gateway_failures(pod) for pod in stack.pods(GATEWAY)}

    probes = {
        "engine Ready": lambda: ready_pod_count(api, namespace, stack.selector(ENGINE)) > 0,
        "gateway endpoint ready": lambda: bool(ready_endpoints(api, namespace, gateway_service)),
    }
    with SteadyLoad(stack, workers=2) as load, Timeline(probes) as timeline:
        scaled = time.monotonic()
        _scale(stack, 1)
        wait_for("an answer through the Ingress", lambda: any(o.ok for o in load.snapshot()), READY_TIMEOUT_S, 1.0)
        wait_for("both gateways Ready", lambda: len(stack.ready_pods(GATEWAY)) == 2, timeout_s=60)
        time.sleep(5)  # steady traffic over both gateways once they serve
    outcomes = load.outcomes
    engine_ready, gateway_ready = timeline.first["engine Ready"], timeline.first["gateway endpoint ready"]
    first_answer = min(o.started + o.seconds for o in outcomes if o.ok)
    refused_at_ingress = Counter(o.status for o in outcomes if not o.from_gateway)
    failed_at_gateway = [o for o in outcomes if o.from_gateway and not o.ok]
    lost_after_first = [o for o in outcomes if o.started > first_answer and not o.ok]
    log.info(
        "engine scaled 0 -> 1: engine pod Ready %.1f s after the scale, a gateway endpoint ready %.1f s after the "
        "engine, first answer through the Ingress %.1f s after the scale; %d requests: %d answered, %d refused by "
        "the Ingress with no ready gateway (status %s), %d failed at a gateway, %d lost after the first answer; %s",
        engine_ready - scaled, gateway_ready - engine_ready, first_answer - scaled, len(outcomes),
        sum(o.ok for o in outcomes), sum(refused_at_ingress.values()), dict(refused_at_ingress),
        len(failed_at_gateway), len(lost_after_first), latency_summary(outcomes),
    )  # fmt: skip
    assert gateway_ready >= engine_ready, "a gateway took traffic before any engine was Ready"
    assert not [o for o in outcomes if o.ok and o.started + o.seconds < engine_ready], "answered with no engine"
    assert not failed_at_gateway, "requests reached a gateway that could not serve them: " + ", ".join(
        f"{o.status} {o.started - scaled:+.1f} s after the scale: {o.detail}" for o in failed_at_gateway[:5]
    )
    assert not lost_after_first, f"requests failed once the deployment served: {lost_after_first[:5]}"
    # The gateways' own counters agree: none of them answered anything but 2xx while the engine loaded.
    for pod in stack.pods(GATEWAY):
        assert gateway_failures(pod) == gateways.get(pod["metadata"]["name"], {}), pod["metadata"]["name"]
    assert {pod["metadata"]["name"] for pod in stack.pods(GATEWAY)} == set(gateways), "a gateway pod restarted"


def test_scale_adds_a_serving_engine(stack: Served) -> None:
    """`kubectl scale m3d/NAME --replicas=2` starts a second engine pod, the gateways find it through the
    headless Service, and requests land on both engine pods (their own request counters say so)."""
    first = stack.wait_engines(1)
    started = time.monotonic()
    _scale(stack, 2)
    engines = stack.wait_engines(2)
    ready_s = time.monotonic() - started
    stack.gateways_see({pod["status"]["podIP"] for pod in engines})
    routed_s = time.monotonic() - started
    added = [pod for pod in engines if pod["metadata"]["name"] != first[0]["metadata"]["name"]]
    assert len(added) == 1

    before = {pod["metadata"]["name"]: engine_successes(pod) for pod in engines}
    with IngressClient(stack) as ingress:
        outcomes = [ingress.chat(f"Request {index}: say something.") for index in range(12)]

    def served_by() -> dict[str, float]:
        return {pod["metadata"]["name"]: engine_successes(pod) - before[pod["metadata"]["name"]] for pod in engines}

    # An engine counts a request when it finishes it, a moment before the gateway answers.
    wait_for("the engines to count every request", lambda: sum(served_by().values()) >= len(outcomes), 10)
    counts = served_by()
    log.info(
        "scaled 1 -> 2: new engine pod %s Ready %.1f s after the scale, in every gateway's pool %.1f s after; "
        "12 requests through the Ingress, %d lost, per engine pod %s; %s",
        added[0]["metadata"]["name"], ready_s, routed_s, sum(not o.ok for o in outcomes), counts,
        latency_summary(outcomes),
    )  # fmt: skip
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    assert all(count >= 1 for count in counts.values()), f"an engine pod served nothing: {counts}"
    assert sum(counts.values()) == len(outcomes)


def _engine_holding_the_stream(stack: Served, engines: list[dict]) -> dict:
    """The engine pod a gateway has the one open request on (the gateways' in-flight gauges, by engine)."""

    def holder() -> dict | None:
        for gateway in stack.ready_pods(GATEWAY):
            for labels, value in scrape(gateway, GATEWAY_PORT).get("m3stack_gateway_engine_inflight_requests", []):
                if value >= 1:
                    host = labels["engine"].rpartition(":")[0]
                    return next((pod for pod in engines if pod["status"]["podIP"] == host), None)
        return None

    return wait_for("the engine holding the stream", holder, timeout_s=30)


def test_engine_pod_deleted_mid_stream(stack: Served) -> None:
    """An engine pod deleted while it streams: the client gets an OpenAI error event (not a silent cut or a
    hang) once the pod's drain deadline passes, and the next request succeeds on the other engine pod."""
    if len(stack.pods(ENGINE)) != 2:
        _scale(stack, 2)
    engines = stack.wait_engines(2)
    stack.gateways_see({pod["status"]["podIP"] for pod in engines})
    chat = _openai(stack)
    started = time.monotonic()
    stream = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a very long story."}],
        max_tokens=STREAM_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    received = sum(1 for _ in zip(range(5), chunks, strict=False))
    first_tokens_s = time.monotonic() - started
    victim = _engine_holding_the_stream(stack, engines)
    survivor = next(pod for pod in engines if pod is not victim)
    survivor_before = engine_successes(survivor)

    deleted = time.monotonic()
    stack.kube("delete", "pod", victim["metadata"]["name"], "--wait=false")
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            received += 1
    error_s = time.monotonic() - deleted
    error = caught.value
    log.info(
        "engine pod %s deleted %.1f s into a stream (%d chunks so far); the client got %s %r %.1f s after the "
        "delete, after %d chunks",
        victim["metadata"]["name"], first_tokens_s, 5, type(error).__name__, error.message, error_s, received,
    )  # fmt: skip
    assert isinstance(error.body, dict) and error.body.get("code") == "engine_error", error.body
    assert received < STREAM_TOKENS

    answered = time.monotonic()
    reply = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And now?"}], max_tokens=8)
    next_s = time.monotonic() - answered
    wait_for("the surviving engine to count it", lambda: engine_successes(survivor) > survivor_before, 10)
    served_by_survivor = engine_successes(survivor) - survivor_before
    log.info(
        "the next request: answered in %.0f ms (%d tokens), by the surviving engine pod %s (+%d finished there)",
        next_s * 1e3, reply.usage.completion_tokens, survivor["metadata"]["name"], served_by_survivor,
    )  # fmt: skip
    assert reply.choices[0].message is not None and reply.usage.completion_tokens >= 1
    assert served_by_survivor == 1
    # The Deployment replaces the deleted pod; the next test starts from two engines again.
    stack.wait_engines(2)


def test_gateway_rolling_update_loses_no_request(stack: Served) -> None:
    """A gateway flag changed through the M3Deployment (thinkingMode, a ConfigMap setting) rolls the gateway
    pods one at a time; a steady load through the Ingress loses no request, and the engines are not touched."""
    engines_before = {pod["metadata"]["name"] for pod in stack.pods(ENGINE)}
    old_gateways = {pod["metadata"]["name"] for pod in stack.pods(GATEWAY)}
    deployment = f"{stack.name}-gateway"
    with SteadyLoad(stack, workers=2) as load:
        time.sleep(3)  # the load runs before the change
        started = time.monotonic()
        stack.kube(
            "patch",
            "m3d",
            stack.name,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"gateway": {"thinkingMode": "Disabled"}}}),
        )
        stack.kube("rollout", "status", f"deployment/{deployment}", "--timeout=300s")
        rolled_s = time.monotonic() - started
        # Until the old pods are gone: their preStop and drain happen under the load too.
        wait_for("the old gateway pods to be gone", lambda: not old_gateways & _all_names(stack, GATEWAY), 180, 1.0)
        gone_s = time.monotonic() - started
        time.sleep(3)
    outcomes = load.outcomes
    lost = [o for o in outcomes if not o.ok]
    new_gateways = stack.ready_pods(GATEWAY)
    log.info(
        "gateway rolling update (thinkingMode -> Disabled): rollout complete %.1f s after the patch, old pods gone "
        "after %.1f s; %d requests under load, %d lost; %s",
        rolled_s, gone_s, len(outcomes), len(lost), latency_summary(outcomes),
    )  # fmt: skip
    assert not lost, f"{len(lost)} requests lost during the rolling update: {lost[:5]}"
    assert len(outcomes) >= 20, "too little load to show anything"
    assert len(new_gateways) == 2 and not old_gateways & {pod["metadata"]["name"] for pod in new_gateways}
    config = stack.kube.json("get", "configmap", f"{stack.name}-config")["data"]
    assert config["M3STACK_GATEWAY_THINKING_MODE"] == "disabled"
    assert {pod["metadata"]["name"] for pod in stack.pods(ENGINE)} == engines_before, "the engines were restarted"


def test_engine_network_policy_selects_the_real_pods(stack: Served) -> None:
    """The operator's NetworkPolicy for the engines, checked against the running pods: it selects exactly the
    engine pods, lets exactly the gateway pods reach the gRPC port the gateways really use, leaves the
    metrics port (kubelet probes, Prometheus) open, and no policy stands between the Ingress and the
    gateways.  This node's CNI chain (bridge, portmap) does not enforce NetworkPolicy, so a pod outside the
    policy still connects; Calico, Cilium or kube-router's firewall would refuse it."""
    policy = stack.kube.json("get", "networkpolicy", f"{stack.name}-engine")["spec"]
    engines, gateways = stack.ready_pods(ENGINE), stack.ready_pods(GATEWAY)
    assert engines and gateways

    def selected(match_labels: dict[str, str]) -> set[str]:
        selector = ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))
        return {pod["metadata"]["name"] for pod in stack.kube.json("get", "pods", "-l", selector)["items"]}

    assert policy["policyTypes"] == ["Ingress"]
    assert selected(policy["podSelector"]["matchLabels"]) == _names(stack.pods(ENGINE))
    grpc_rule, peers_rule, metrics_rule = policy["ingress"]
    assert selected(grpc_rule["from"][0]["podSelector"]["matchLabels"]) == _names(stack.pods(GATEWAY))
    assert selected(peers_rule["from"][0]["podSelector"]["matchLabels"]) == _names(stack.pods(ENGINE))
    assert "from" not in metrics_rule  # open to probes and monitoring

    # The named ports resolve, in every selected pod, to the ports the gateways and probes really use.
    for pod in engines:
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert grpc_rule["ports"] == [{"protocol": "TCP", "port": "grpc"}] and ports["grpc"] == ENGINE_GRPC_PORT
        assert metrics_rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
        probe = pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"]
        assert probe == "metrics"
    routed = set()
    for gateway in gateways:
        routed |= {labels["engine"] for labels, _ in scrape(gateway, GATEWAY_PORT)["m3stack_gateway_engine_ready"]}
    assert routed == {f"{pod['status']['podIP']}:{ENGINE_GRPC_PORT}" for pod in engines}

    # Nothing restricts who reaches the gateways: the Ingress controller's path stays open.
    for other in stack.kube.json("get", "networkpolicies")["items"]:
        assert not _names(gateways) & selected(other["spec"]["podSelector"].get("matchLabels", {})), other["metadata"]

    cni_config = json.loads((stack.cluster.run_dir / "cni" / "10-m3stack.conflist").read_text())
    plugins = [plugin["type"] for plugin in cni_config["plugins"]]
    assert plugins == ["bridge", "portmap"], f"a different CNI chain ({plugins}): check enforcement here instead"
    reached = _connect_from_outsider(stack, [pod["status"]["podIP"] for pod in engines])
    log.info(
        "NetworkPolicy %s-engine selects %d engine pods, admits %d gateway pods on grpc/%d; CNI chain %s does not "
        "enforce it (a pod outside the policy connected to %s); Calico, Cilium or kube-router --run-firewall would",
        stack.name, len(engines), len(gateways), ENGINE_GRPC_PORT, plugins, reached,
    )  # fmt: skip
    assert reached == {pod["status"]["podIP"]: True for pod in engines}


OUTSIDER_SCRIPT = """
import json, socket, sys
result = {}
for ip in sys.argv[1:]:
    with socket.socket() as sock:
        sock.settimeout(5)
        result[ip] = sock.connect_ex((ip, %d)) == 0
print(json.dumps(result))
"""


def _names(pods: list[dict]) -> set[str]:
    return {pod["metadata"]["name"] for pod in pods}


def _all_names(stack: Served, component: str) -> set[str]:
    """Every pod of the component, terminating ones included."""
    return _names(stack.kube.json("get", "pods", "-l", stack.selector(component))["items"])


def _connect_from_outsider(stack: Served, engine_ips: list[str]) -> dict[str, bool]:
    """Runs a pod the policy does not admit (no gateway labels) that opens a TCP connection to each engine's
    gRPC port; returns IP -> connected."""
    stack.kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "outsider", "labels": {"app": "outsider"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "outsider",
                        "image": stack.cluster.images["operator"],
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python3", "-c", OUTSIDER_SCRIPT % ENGINE_GRPC_PORT, *engine_ips],
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                    }
                ],
            },
        }
    )

    def finished() -> str | None:
        phase = stack.kube.json("get", "pod", "outsider")["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("the outsider pod to finish", finished, timeout_s=120)
    output = stack.kube("logs", "outsider")
    stack.kube("delete", "pod", "outsider", "--wait=false")
    assert phase == "Succeeded", output
    return json.loads(output.strip().splitlines()[-1])
