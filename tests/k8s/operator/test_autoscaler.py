"""The engine autoscaler end to end: the operator (chart RBAC) on the real control plane, real gateways in
front of the tiny CPU engine on loopback, and a load generator raising and lowering the concurrency.

The engine pods on the control plane are fake (kwok), the gateways and the engine are real processes:
the operator reads the gateways' in-flight counts through ``--autoscaler-metrics-urls`` (loopback URLs;
pod IPs here are fake and never contacted) and scales the fake engine Deployment through /scale.
Windows are short (stable 20 s, panic 4 s, scale-down delay 10 s) so a test takes a minute or two; the
reaction times are printed (``-s``) and checked against bounds that follow from those windows.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from autoscaler_load import LoadGenerator, LoopbackStack, unused_address
from controlplane import ControlPlaneError
from keda_crd import scaled_object_crd
from kubernetes import client
from m3d_testkit import Kube, m3deployment, wait_for

WINDOWS = {"stableWindowSeconds": 20, "panicWindowSeconds": 4, "scaleDownDelaySeconds": 10}
INTERVAL_S = 2.0  # the operator's default --autoscaler-interval
TARGET = 2  # in-flight requests per engine: targetConcurrency 2 at utilization 1
METRICS_URLS_ENV = "M3STACK_OPERATOR_AUTOSCALER_METRICS_URLS"


@dataclass
class Loopback:
    model: str
    gateways: list[str]  # in front of the engine
    engineless: str  # refuses every request with 503 (what gateways do while no engine runs)


@pytest.fixture(scope="module")
def loopback(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loopback]:
    stack = LoopbackStack(tiny_model_dir, tmp_path_factory.mktemp("autoscaler-stack"))
    try:
        engine = stack.engine()
        *gateways, engineless = stack.gateways([[engine], [engine], [unused_address()]])
        yield Loopback(tiny_model_dir.name, gateways, engineless)
    finally:
        stack.stop()


@dataclass
class Watcher:
    """Reads the M3Deployment and its engine pods with the Python client (cheaper than kubectl)."""

    api: client.ApiClient
    namespace: str
    name: str
    started: float = field(default_factory=time.monotonic)

    def m3d(self) -> dict:
        return client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            "m3stack.io", "v1alpha1", self.namespace, "m3deployments", self.name
        )

    def replicas(self) -> int:
        return int(self.m3d()["spec"]["engine"]["replicas"])

    def autoscaling(self) -> dict:
        return self.m3d().get("status", {}).get("autoscaling", {})

    def condition(self) -> dict:
        conditions = self.m3d().get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "AutoscalingActive"), {})

    def ready_engines(self) -> int:
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=f"m3stack.io/deployment={self.name},m3stack.io/component=engine"
        )
        return sum(
            1
            for pod in pods.items
            if pod.metadata.deletion_timestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        )

    def autoscaler_events(self) -> list[dict]:
        events = client.CoreV1Api(self.api).list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={self.name}"
        )
        return [
            {"type": e.type, "reason": e.reason, "message": e.message}
            for e in events.items
            if e.reporting_component == "m3stack-autoscaler"
        ]

    def until(self, what: str, probe: Callable[[], object], timeout_s: float) -> float:
        """Seconds until probe() is truthy (polled every 0.25 s)."""
        start = time.monotonic()
        wait_for(what, probe, timeout_s=timeout_s, interval_s=0.25)
        return time.monotonic() - start


class Timeline:
    """Samples replicas, ready engines and the autoscaler's status every half second, in a thread, and
    prints the changes: what happened when (the reaction times in the report, a missed bound)."""

    def __init__(self, watch: Watcher) -> None:
        self.watch = watch
        self.rows: list[tuple[float, tuple[object, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="timeline", daemon=True)
        self.started = time.monotonic()

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        changes = [row for i, row in enumerate(self.rows) if i == 0 or row[1] != self.rows[i - 1][1]]
        lines = [
            f"{at:6.1f}s replicas={replicas} ready={ready} {state}/{reason}"
            for at, (replicas, ready, state, reason) in changes
        ]
        sys.stderr.write("\ntimeline (changes):\n  " + "\n  ".join(lines) + "\n")

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            at = time.monotonic() - self.started
            try:
                body = self.watch.m3d()
                ready = self.watch.ready_engines()
            except client.ApiException:
                continue
            status = body.get("status", {}).get("autoscaling", {})
            replicas = int(body["spec"]["engine"]["replicas"])
            self.rows.append((at, (replicas, ready, status.get("state"), status.get("reason"))))


def report(measurements: dict[str, float]) -> None:
    sys.stderr.write("\nautoscaler reaction times: " + json.dumps({k: round(v, 1) for k, v in measurements.items()}))
    sys.stderr.write("\n")


def builtin(extra: dict | None = None) -> dict:
    return {
        "mode": "Builtin",
        "minReplicas": 1,
        "maxReplicas": 8,
        "targetConcurrency": TARGET,
        "targetUtilization": 1.0,
        **WINDOWS,
        **(extra or {}),
    }


def test_engines_follow_the_load_and_stop_at_the_capacity(
    loopback, operator, kube: Kube, k8s_client, k8s_node_pool, monkeypatch
):
    pool = k8s_node_pool(count=1, gpus=3)  # room for three one-GPU engines, no more
    urls = ",".join(f"{gateway}/metrics" for gateway in loopback.gateways)
    monkeypatch.setenv(METRICS_URLS_ENV, f"{kube.namespace}/busy={urls}")
    operator.start()
    engine = {"nodeSelector": pool.node_selector, "tolerations": [pool.toleration]}
    kube.apply(m3deployment("busy", {"engine": engine, "autoscaling": {"engine": builtin()}}))
    kube.wait_all_ready("busy")
    watch = Watcher(k8s_client(), kube.namespace, "busy")
    watch.until(
        "the autoscaler reading both gateways",
        lambda: watch.autoscaling().get("gatewaysScraped") == 2 and watch.condition().get("status") == "True",
        timeout_s=30,
    )
    # (The first pod listing also imports the client's models: seconds, kept out of the measurements.)
    assert (watch.replicas(), watch.ready_engines()) == (1, 1)
    measured: dict[str, float] = {}

    with Timeline(watch), LoadGenerator(loopback.gateways, loopback.model) as load:
        # A burst: 6 requests in flight want 3 engines; panic mode reacts within its window.
        load.set_level(6)
        measured["burst: first scale-up"] = watch.until("a scale-up", lambda: watch.replicas() > 1, timeout_s=30)
        measured["burst: 3 engines ready"] = measured["burst: first scale-up"] + watch.until(
            "3 ready engines", lambda: watch.ready_engines() == 3 and watch.replicas() == 3, timeout_s=30
        )
        first = watch.autoscaling()["recentDecisions"][0]
        assert (first["fromReplicas"], first["state"]) == (1, "Panic")
        assert measured["burst: first scale-up"] < WINDOWS["stableWindowSeconds"], (
            "the burst waited for a stable window"
        )

        # 8 in flight want a 4th engine: it cannot be placed.
        load.set_level(8)
        measured["overload: InsufficientCapacity"] = watch.until(
            "InsufficientCapacity in status",
            lambda: watch.autoscaling().get("reason") == "InsufficientCapacity" and watch.replicas() == 4,
            timeout_s=60,
        )
        # 12 in flight want 6 (and 2 x 3 ready engines would allow it): no replica is added meanwhile.
        load.set_level(12)
        held = []
        for _ in range(int(5 * INTERVAL_S / 0.5)):
            held.append((watch.replicas(), watch.autoscaling().get("reason")))
            time.sleep(0.5)
        assert set(held) == {(4, "InsufficientCapacity")}, held
        condition = watch.condition()
        assert (condition["status"], condition["reason"]) == ("True", "InsufficientCapacity")
        assert "cannot be scheduled" in condition["message"]
        assert kube.condition("busy", "Degraded").get("reason") == "InsufficientCapacity"

        # The load goes away: panic ends after a stable window, the scale-down waits for the delay.
        load.set_level(0)
        stopped = time.monotonic()
        watch.until("a scale-down", lambda: watch.replicas() < 4, timeout_s=90)
        measured["idle: first scale-down"] = time.monotonic() - stopped
        measured["idle: back to 1 engine"] = measured["idle: first scale-down"] + watch.until(
            "1 engine", lambda: watch.replicas() == 1 and watch.ready_engines() == 1, timeout_s=60
        )
    report(measured)
    sys.stderr.write(f"decisions: {json.dumps(watch.autoscaling()['recentDecisions'])}\n")
    assert measured["idle: first scale-down"] >= WINDOWS["scaleDownDelaySeconds"], "scaled down before the delay"
    assert load.outcomes["200"] > 0 and not [k for k in load.outcomes if k != "200"], load.outcomes

    status = watch.autoscaling()
    steps = [(d["fromReplicas"], d["toReplicas"]) for d in status["recentDecisions"]]
    assert steps[0] == (1, 2) and steps[-1][1] == 1 and (3, 4) in steps, steps
    assert status["desiredReplicas"] == 1 and status["mode"] == "Builtin"
    events = watch.autoscaler_events()
    reasons = {(e["type"], e["reason"]) for e in events}
    assert {("Normal", "ScaledUp"), ("Normal", "ScaledDown"), ("Warning", "InsufficientCapacity")} <= reasons, events


def test_scale_to_zero_and_woken_by_refused_requests(loopback, operator, kube: Kube, k8s_client, monkeypatch):
    """minReplicas 0: idle engines go away; requests refused (503) while none runs bring one back."""
    monkeypatch.setenv(METRICS_URLS_ENV, f"{kube.namespace}/idle={loopback.engineless}/metrics")
    operator.start()
    windows = {"stableWindowSeconds": 6, "panicWindowSeconds": 2, "scaleDownDelaySeconds": 4}
    kube.apply(m3deployment("idle", {"autoscaling": {"engine": builtin({"minReplicas": 0, **windows})}}))
    # Not kube.wait_all_ready: on a slow machine the autoscaler can scale the idle engine away before a
    # poll sees Ready, and a deployment at zero engines is not Ready.  The decision shows it went 1 -> 0.
    watch = Watcher(k8s_client(), kube.namespace, "idle")
    measured = {"idle: to zero": watch.until("zero engines", lambda: watch.replicas() == 0, timeout_s=120)}
    watch.until(
        "the decision in status",
        lambda: (
            [(d["fromReplicas"], d["toReplicas"]) for d in watch.autoscaling().get("recentDecisions", [])] == [(1, 0)]
        ),
        timeout_s=10,
    )
    refused = 0
    with httpx.Client(timeout=10, trust_env=False) as http:
        started = time.monotonic()

        def woken() -> bool:
            nonlocal refused
            answer = http.post(
                f"{loopback.engineless}/v1/chat/completions",
                json={"model": loopback.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert answer.status_code == 503, answer.text
            refused += 1
            return watch.replicas() >= 1  # panic mode may wake it straight to 2

        wait_for("an engine after refused requests", woken, timeout_s=30, interval_s=0.5)
        measured["refused: back to >= 1 engine"] = time.monotonic() - started
    report(measured)
    # Woken within a few decisions, not after a window of averaging.
    assert measured["refused: back to >= 1 engine"] < windows["stableWindowSeconds"] + 2 * INTERVAL_S, refused
    assert ("Normal", "ScaledUp") in {(e["type"], e["reason"]) for e in watch.autoscaler_events()}


def test_a_deployment_without_metrics_holds_its_engines(operator, kube: Kube, k8s_client, monkeypatch):
    """Gateways that do not answer: no decision on missing data, and status says why."""
    monkeypatch.setenv(METRICS_URLS_ENV, f"{kube.namespace}/blind=http://127.0.0.1:9/metrics")  # discard port
    operator.start()
    kube.apply(m3deployment("blind", {"engine": {"replicas": 2}, "autoscaling": {"engine": builtin()}}))
    kube.wait_all_ready("blind")
    watch = Watcher(k8s_client(), kube.namespace, "blind")
    watch.until(
        "AutoscalingActive=False NoMetrics",
        lambda: (watch.condition().get("status"), watch.condition().get("reason")) == ("False", "NoMetrics"),
        timeout_s=30,
    )
    assert "0 of 1 gateways answered (http://127.0.0.1:9/metrics:" in watch.condition()["message"]
    time.sleep(3 * INTERVAL_S)
    assert watch.replicas() == 2
    assert watch.autoscaling()["gatewaysScraped"] == 0


@pytest.fixture
def keda_crd(k8s_cluster) -> Iterator[None]:
    """KEDA's ScaledObject CRD (no KEDA controller: nothing acts on ScaledObjects here)."""
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(scaled_object_crd()))
    k8s_cluster.wait_crd_established("scaledobjects.keda.sh")
    yield
    k8s_cluster.kubectl("delete", "crd", "scaledobjects.keda.sh", "--wait=false")


def test_keda_and_hpa_modes_hand_scale_to_their_object(keda_crd, operator, kube: Kube, monkeypatch):
    monkeypatch.setenv(METRICS_URLS_ENV, f"{kube.namespace}/none=http://127.0.0.1:9/metrics")  # never discover pods
    operator.start()
    prometheus = {"serverAddress": "http://prometheus.invalid:9090"}  # KEDA would query it; nothing does here
    engine_scaling = {"mode": "KEDA", "minReplicas": 0, "maxReplicas": 5, "prometheus": prometheus}
    kube.apply(m3deployment("ext", {"autoscaling": {"engine": engine_scaling}}))
    kube.wait_all_ready("ext")
    scaled = wait_for("the ScaledObject", lambda: kube.try_json("get", "scaledobject", "ext-engine"))
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "m3stack.io/v1alpha1",
        "kind": "M3Deployment",
        "name": "ext",
    }
    assert scaled["spec"]["minReplicaCount"] == 0
    assert 'status="503"' in scaled["spec"]["triggers"][0]["metadata"]["query"]
    condition = wait_for(
        "AutoscalingActive from the autoscaler",
        lambda: (c := kube.condition("ext", "AutoscalingActive")).get("reason") == "ExternalAutoscaler" and c,
    )
    assert "KEDA ScaledObject ext-engine" in condition["message"]
    assert kube.m3d("ext")["status"]["autoscaling"] == {"mode": "KEDA"}

    kube(
        "patch",
        "m3d/ext",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"autoscaling": {"engine": {"mode": "HPA", "minReplicas": 1}}}}),
    )
    wait_for("the ScaledObject pruned", lambda: kube.try_json("get", "scaledobject", "ext-engine") is None)
    hpa = wait_for("the engines' HPA", lambda: kube.try_json("get", "hpa", "ext-engine"))
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "M3Deployment"
    # The real HPA controller reads the M3Deployment's /scale (it has no metrics API to go further).
    able = wait_for(
        "the HPA able to read /scale",
        lambda: next(
            (c for c in (kube.try_json("get", "hpa", "ext-engine") or {}).get("status", {}).get("conditions", [])
             if c["type"] == "AbleToScale" and c["status"] == "True"),
            None,
        ),
    )  # fmt: skip
    assert able["reason"] == "SucceededGetScale"
    wait_for("status mode HPA", lambda: kube.m3d("ext")["status"].get("autoscaling") == {"mode": "HPA"})

    kube("patch", "m3d/ext", "--type=merge", "-p", json.dumps({"spec": {"autoscaling": {"engine": {"mode": "None"}}}}))
    wait_for("the HPA pruned", lambda: kube.try_json("get", "hpa", "ext-engine") is None)
    wait_for(
        "AutoscalingActive=False Disabled and no autoscaler status",
        lambda: (
            kube.condition("ext", "AutoscalingActive").get("reason") == "Disabled"
            and "autoscaling" not in kube.m3d("ext")["status"]
        ),
    )


@pytest.mark.parametrize(
    ("scaling", "complaint"),
    [
        ({"mode": "KEDA"}, "autoscaling.engine.prometheus.serverAddress is required in mode KEDA"),
        ({"mode": "HPA", "minReplicas": 0}, "autoscaling.engine.minReplicas must be >= 1 in mode HPA"),
        ({"mode": "Builtin", "maxScaleUpRate": 1}, "maxScaleUpRate"),
        ({"mode": "KEDA", "prometheus": {"serverAddress": "prometheus:9090"}}, "serverAddress"),
    ],
)
def test_unusable_autoscaling_settings_are_refused(kube: Kube, chart, scaling, complaint):
    with pytest.raises(ControlPlaneError, match=complaint):
        kube.apply(m3deployment("refused", {"autoscaling": {"engine": scaling}}))
