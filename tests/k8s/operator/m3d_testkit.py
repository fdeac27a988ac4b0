"""Helpers for the operator's tests on the real control plane: polling, kubectl with JSON, the
operator process, M3Deployment builders."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import controlplane
import pytest
from controlplane import ControlPlane

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART = REPO_ROOT / "helm" / "m3stack"
EXAMPLE = CHART / "examples" / "m3deployment.yaml"
RELEASE = "m3stack"
RELEASE_NAMESPACE = "m3stack-system"
SERVICE_ACCOUNT = "m3stack"  # the chart's fullname for this release name
# An xdist group for modules that want one worker.  Note: with pytest 9.2 + xdist 3.8 here, loadgroup
# does not group (the workers never suffix node ids); the chart fixture does not rely on it.
GROUP = "m3stack-operator"
T = TypeVar("T")


# Upper bounds only (a healthy run takes seconds): the control plane shares two cores with the rest
# of the suite, and a loaded CI machine must not turn slowness into failures.
WAIT_S = 120.0
# Every desired replica ready: Ready (it serves) and each tier's own condition (all its replicas).
ALL_READY_CONDITIONS = ("Ready", "EnginesReady", "GatewayReady")


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout_s: float = WAIT_S,
    interval_s: float = 0.3,
    detail: Callable[[], str] | None = None,
) -> T:
    """Polls probe() until it returns something truthy, and returns that; ``detail`` explains a timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    context = detail() if detail is not None else f"last: {str(last)[:2000]}"
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} ({context})")


class Kube:
    """kubectl in one namespace; ``json(...)`` parses ``-o json`` output."""

    def __init__(self, cluster: ControlPlane, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace

    def __call__(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl("-n", self.namespace, *args, input=input)

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json", "--show-managed-fields"))

    def try_json(self, *args: str) -> Any | None:
        try:
            return self.json(*args)
        except controlplane.ControlPlaneError:
            return None

    def apply(self, manifest: dict[str, Any]) -> str:
        return self("apply", "-f", "-", input=json.dumps(manifest))

    def m3d(self, name: str) -> dict[str, Any]:
        return self.json("get", "m3deployment", name)

    def children(
        self,
        name: str,
        kinds: str = "deployments,services,configmaps,poddisruptionbudgets,hpa,ingresses,networkpolicies",
    ) -> list[dict]:
        return self.json("get", kinds, "-l", f"m3stack.io/deployment={name}")["items"]

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for condition in self.m3d(name).get("status", {}).get("conditions", []):
            if condition["type"] == type_:
                return condition
        return {}

    def wait_all_ready(self, name: str, timeout_s: float = 2 * WAIT_S) -> dict[str, Any]:
        """Waits until every desired replica is ready and the rollout is done, for the current generation, and
        returns the resource.  Ready alone only says it serves (one engine behind one gateway): a scale-up keeps it
        True while the new replicas load, so EnginesReady and GatewayReady are what say they are up."""

        def ready() -> dict[str, Any] | None:
            body = self.m3d(name)
            status = body.get("status", {})
            conditions = {c["type"]: c for c in status.get("conditions", [])}
            current = status.get("observedGeneration") == body["metadata"]["generation"]
            settled = conditions.get("Progressing", {}).get("status") == "False"
            all_ready = all(conditions.get(type_, {}).get("status") == "True" for type_ in ALL_READY_CONDITIONS)
            return body if current and settled and all_ready else None

        def status() -> str:
            body = self.try_json("get", "m3deployment", name) or {}
            return f"generation {body.get('metadata', {}).get('generation')}, status {json.dumps(body.get('status'))}"

        return wait_for(f"M3Deployment {name}'s replicas all to be ready", ready, timeout_s, detail=status)


class OperatorProcess:
    """`m3stack operator` on the host, authenticated with the chart's ServiceAccount token."""

    def __init__(self, cluster: ControlPlane, kubeconfig: Path, namespace: str, log_path: Path) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.port = 0  # of /healthz and /metrics, once started

    def start(self, drift_interval_s: float = 5.0, extra_args: tuple[str, ...] = ()) -> OperatorProcess:
        port = self.port = controlplane.free_port()
        command = [
            sys.executable, "-m", "m3stack", "--log-level", "INFO", "operator",
            "--namespace", self.namespace, "--liveness-host", "127.0.0.1", "--liveness-port", str(port),
            "--drift-interval", str(drift_interval_s),
            "--engine-image", "registry.invalid/m3stack/engine:test",
            "--gateway-image", "registry.invalid/m3stack/gateway:test",
            *extra_args,
        ]  # fmt: skip
        log = self.log_path.open("a")
        self.process = self.cluster.popen(
            command, kubeconfig=self.kubeconfig, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        log.close()

        def alive() -> bool:
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response,
            ):
                return response.status == 200
            return False

        wait_for("the operator's /healthz", alive, timeout_s=60)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:]) if self.log_path.exists() else ""


SMALL_ENGINE = {
    "accelerator": {"count": 1, "product": "NVIDIA-H200"},
    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
    "shmSize": "64Mi",
}
SMALL_GATEWAY = {"resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def m3deployment(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    base = {"model": {"name": "m3-tiny"}, "engine": SMALL_ENGINE, "gateway": {"replicas": 1, **SMALL_GATEWAY}}
    return {
        "apiVersion": "m3stack.io/v1alpha1",
        "kind": "M3Deployment",
        "metadata": {"name": name},
        "spec": _merge(base, spec or {}),
    }


def deployment(kube: Kube, name: str) -> dict[str, Any] | None:
    return kube.try_json("get", "deployment", name)


def live_pods(kube: Kube, selector: str) -> list[dict[str, Any]]:
    return [
        pod for pod in kube.json("get", "pods", "-l", selector)["items"] if not pod["metadata"].get("deletionTimestamp")
    ]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))
