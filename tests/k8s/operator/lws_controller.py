"""The LeaderWorkerSet controller (built by tests/k8s/infra/build-lws) as a host process on the test control plane.

LWS labels and configures a group's pods in its pod mutating webhook (group and worker index labels, the
LWS_LEADER_ADDRESS / LWS_WORKER_INDEX variables), and its controllers rely on those labels.  The API server
reaches the webhook at https://127.0.0.1 with a throwaway self-signed certificate; the webhook configuration
only covers namespaces labelled ``WEBHOOK_NAMESPACE_LABEL`` (failurePolicy Fail stays confined to the tests
that asked for it) and is deleted on stop.  Certificate management and leader election are off.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import urllib.request
from pathlib import Path

import controlplane
from controlplane import ControlPlane
from m3d_testkit import wait_for

WEBHOOK_NAMESPACE_LABEL = "m3stack.io/lws-webhook"
WEBHOOK_CONFIGURATION = "m3stack-test-lws-pods"


class LwsController:
    def __init__(self, cluster: ControlPlane, binary: Path, run_dir: Path) -> None:
        self.cluster = cluster
        self.binary = binary
        self.run_dir = run_dir
        self.process: subprocess.Popen | None = None

    def start(self) -> LwsController:
        certs = self.run_dir / "certs"
        certs.mkdir(parents=True)
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(certs / "tls.key"), "-out", str(certs / "tls.crt")],
            check=True, capture_output=True,
        )  # fmt: skip
        webhook_port, health_port = controlplane.free_port(), controlplane.free_port()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
        }
        (self.run_dir / "config.yaml").write_text(json.dumps(config))
        with (self.run_dir / "lws.log").open("w") as log:
            self.process = subprocess.Popen(
                [str(self.binary), "--config", str(self.run_dir / "config.yaml"),
                 "--kubeconfig", str(self.cluster.kubeconfig)],
                stdout=log, stderr=subprocess.STDOUT, env=self.cluster.env(),
            )  # fmt: skip
        wait_for("the LWS controller's /readyz", lambda: self._ready(health_port))
        self._register_webhook(webhook_port, (certs / "tls.crt").read_bytes())
        return self

    def _ready(self, port: int) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"the LWS controller exited with {self.process.returncode}:\n{self.log_tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status == 200
        return False

    def _register_webhook(self, port: int, ca: bytes) -> None:
        webhook = {
            "name": "mpod.kb.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 10,
            "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate--v1-pod",
                             "caBundle": base64.b64encode(ca).decode()},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
            "namespaceSelector": {"matchLabels": {WEBHOOK_NAMESPACE_LABEL: "on"}},
        }  # fmt: skip
        configuration = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK_CONFIGURATION},
            "webhooks": [webhook],
        }
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(configuration))

    def stop(self) -> None:
        self.cluster.kubectl("delete", "mutatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "--ignore-not-found")
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def log_tail(self, lines: int = 40) -> str:
        path = self.run_dir / "lws.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""
