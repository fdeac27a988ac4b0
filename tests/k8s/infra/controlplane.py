"""Start and stop the Kubernetes test control plane on loopback.

etcd, kube-apiserver (RBAC, service-account token signing), kube-controller-manager,
kube-scheduler and kwok run as host processes bound to 127.0.0.1 on free ports, with their state,
certificates, logs and an admin kubeconfig in one run folder.  kwok fakes the nodes listed in
nodes.yaml (GPU capacity included) and moves their pods through the usual phases, so Deployments
become Ready without a kubelet or a container runtime.  Stopping signals exactly the recorded pids.

Standard library only (plus `openssl` and the binaries from ./build), so the `up`/`down`
scripts run with any python3 and pytest imports it as is.

    python3 controlplane.py up RUN_DIR     start, print `export ...` lines for a shell
    python3 controlplane.py down RUN_DIR   stop the processes recorded in RUN_DIR, remove it
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from processes import ProcessId, launch, terminate

log = logging.getLogger("m3stack.k8s.controlplane")

INFRA_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = INFRA_DIR / "build"
NODES_MANIFEST = INFRA_DIR / "nodes.yaml"
# Our own kwok stages, run after kwok's defaults (share/kwok-stages.yaml from the build).
STAGES_DIR = INFRA_DIR / "stages"
STATE_FILE = "state.json"
CONTEXT = "m3stack-test"
# Components in start order; stopping goes in reverse.  kwok runs only with fake nodes.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Layout:
    """Where a control plane listens, the address ranges it hands out, and what kind of nodes it has."""

    address: str  # the API server binds and advertises here
    service_cidr: str
    kubernetes_service_ip: str  # the `kubernetes` Service's ClusterIP, in the serving certificate
    pod_cidr: str
    # Real kubelets (tests/k8s/infra/realnode.py) instead of kwok's fakes: the Node authorizer and
    # NodeRestriction, the API server's client certificate for kubelets, node CIDRs allocated, the
    # `kubernetes` Endpoints kept on the advertised address.
    real_nodes: bool = False

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS[:-1] if self.real_nodes else COMPONENTS


# The fake nodes' layout.  The addresses are written into API objects only: Services get ClusterIPs
# from the first range, pods get IPs from the second (EndpointSlices refuse loopback pod IPs).
# Nothing listens there, and since they are not loopback, NOTHING may ever connect to them: pods
# are not processes.  Nodes report 127.0.0.1, and the API server reaches "kubelets" by that address
# only, so `kubectl logs` and friends fail on loopback instead of sending traffic off the machine.
FAKE_NODES = Layout(
    address="127.0.0.1", service_cidr="10.96.0.0/16", kubernetes_service_ip="10.96.0.1", pod_cidr="10.244.0.0/16"
)
NODE_IP = "127.0.0.1"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached; the message says why."""


@dataclass(frozen=True)
class ControlPlane:
    """A running control plane: where its files are and how to reach it."""

    run_dir: Path
    bin_dir: Path
    share_dir: Path
    server: str
    processes: dict[str, ProcessId]
    layout: Layout = FAKE_NODES

    @property
    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self.processes.items()}

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "admin.kubeconfig"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    def binary(self, name: str) -> Path:
        """Path of one cached binary: etcd, kubectl, kwok, helm, ct, kubeconform, ..."""
        return self.bin_dir / name

    def env(self, kubeconfig: Path | str | None = None) -> dict[str, str]:
        """os.environ with KUBECONFIG set and the cached binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(
        self, args: Sequence[str], *, kubeconfig: Path | str | None = None, check: bool = True, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        """Runs a command (kubectl, helm, ct, python -m kopf ...) against this cluster and waits for it.

        Output is captured as text; a non-zero exit raises CalledProcessError (with its stderr)
        unless check=False.
        """
        kwargs.setdefault("capture_output", True)
        return subprocess.run(list(args), env=self.env(kubeconfig), text=True, check=check, **kwargs)  # type: ignore[call-overload]

    def popen(self, args: Sequence[str], *, kubeconfig: Path | str | None = None, **kwargs: object) -> subprocess.Popen:
        """Starts a long-running command (an operator, a port server) against this cluster."""
        return subprocess.Popen(list(args), env=self.env(kubeconfig), **kwargs)  # type: ignore[call-overload]

    def get_json(self, path: str) -> dict:
        """GET an API path (e.g. "/openapi/v3") as the admin; decoded JSON."""
        tls = _admin_tls(self.run_dir / "pki")
        with urllib.request.urlopen(f"{self.server}{path}", timeout=30, context=tls) as reply:
            return json.load(reply)

    def kubectl(self, *args: str, input: str | None = None, kubeconfig: Path | str | None = None) -> str:
        """Runs kubectl with this cluster's kubeconfig; returns stdout, raises with stderr on failure."""
        result = self.run([str(self.binary("kubectl")), *args], input=input, kubeconfig=kubeconfig, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def wait_crd_established(self, name: str, timeout_s: float = 60.0) -> None:
        """Until the CRD ``name`` serves its kind.  Not ``kubectl wait --for=condition=Established``: that fails at
        once when it reads the CRD before the API server has written any condition (seen in CI)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            conditions = json.loads(self.kubectl("get", "crd", name, "-o", "json")).get("status", {}).get("conditions")
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions or []):
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"CRD {name} was not established within {timeout_s:.0f}s")

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, duration: str = "1h") -> Path:
        """Writes a kubeconfig that authenticates as ServiceAccount namespace/name (a TokenRequest token).

        Use it to run a component with exactly the RBAC its chart grants it.
        """
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").strip()
        _write_kubeconfig(path, self.server, self.run_dir / "pki" / "ca.crt", {"token": token})
        return path


# ---------------------------------------------------------------------------------------------
# Binaries


def binaries_dir(*, build: bool) -> Path:
    """The versioned folder with bin/ and share/; builds it first (minutes, once) when build=True."""
    args = [str(BUILD_SCRIPT)] if build else [str(BUILD_SCRIPT), "--print-dir"]
    result = subprocess.run(["bash", *args], stdout=subprocess.PIPE, stderr=None if build else subprocess.DEVNULL)
    if result.returncode != 0:
        if build:
            raise ControlPlaneError(f"{BUILD_SCRIPT} failed (exit {result.returncode}); its log says why")
        raise ControlPlaneError(f"the control-plane binaries are not built yet: run {BUILD_SCRIPT}")
    return Path(result.stdout.decode().strip().splitlines()[-1])


def namespaced_crd(group: str, plural: str, kind: str, schema: dict | None = None) -> dict:
    """A namespaced CustomResourceDefinition of one served version, v1, for tests that need a CRD of their own."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural.removesuffix("s"), "kind": kind},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema or {"type": "object"}},
                }
            ],
        },
    }


# ---------------------------------------------------------------------------------------------
# Certificates and kubeconfig


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ControlPlaneError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _issue_certificate(pki: Path, name: str, subject: str, extensions: str) -> None:
    """An EC key and a certificate for it signed by pki/ca.crt, with exactly the given extensions."""
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-days", "30",
        "-set_serial", str(secrets.randbits(63)), "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip


def issue_certificate(pki: Path, name: str, subject: str, *, server_names: Sequence[str] = (), client: bool) -> None:
    """A certificate signed by pki/ca.crt: for clients (subject /O=group/CN=user) or for serving
    (server_names: "DNS:name" and "IP:address" entries)."""
    extensions = f"subjectAltName={','.join(server_names)}\n" if server_names else ""
    extensions += f"extendedKeyUsage={'clientAuth' if client else 'serverAuth'}\nkeyUsage=critical,digitalSignature\n"
    _issue_certificate(pki, name, subject, extensions)


def generate_pki(pki: Path, layout: Layout = FAKE_NODES) -> None:
    """A throwaway CA, the API server's serving certificate, an admin client certificate in
    system:masters, and the service-account token signing key pair (plus, for real nodes, the API
    server's client certificate for kubelets)."""
    pki.mkdir(parents=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "30",
        "-subj", "/CN=m3stack-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", "ca.key", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    kubernetes_names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc"]
    kubernetes_names.append("kubernetes.default.svc.cluster.local")
    addresses = sorted({"127.0.0.1", layout.address, layout.kubernetes_service_ip})
    server_names = [f"DNS:{name}" for name in ("localhost", *kubernetes_names)] + [f"IP:{a}" for a in addresses]
    issue_certificate(pki, "apiserver", "/CN=kube-apiserver", server_names=server_names, client=False)
    issue_certificate(pki, "admin", "/O=system:masters/CN=m3stack-test-admin", client=True)
    if layout.real_nodes:
        # The API server's identity towards kubelets (logs, exec, port-forward), which ask the API server
        # whether it may; in system:masters as kubeadm's apiserver-kubelet-client certificate was.
        issue_certificate(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver", client=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str]) -> None:
    """A one-context kubeconfig.  JSON is valid YAML, and every kubeconfig reader accepts it."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": CONTEXT, "user": user}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT}}],
        "current-context": CONTEXT,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def write_client_kubeconfig(path: Path, server: str, pki: Path, certificate: str) -> None:
    """A kubeconfig that authenticates with pki/<certificate>.crt and .key (see issue_certificate)."""
    user = {
        "client-certificate-data": _b64(pki / f"{certificate}.crt"),
        "client-key-data": _b64(pki / f"{certificate}.key"),
    }
    _write_kubeconfig(path, server, pki / "ca.crt", user)


# ---------------------------------------------------------------------------------------------
# Processes


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on address right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def log_tails(run_dir: Path, lines: int = 25) -> str:
    """The last lines of every run_dir/logs/*.log, for error messages."""
    parts = []
    for path in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


def wait_until(
    what: str, ready: Callable[[], bool], timeout_s: float, run_dir: Path, processes: dict[str, ProcessId]
) -> None:
    """Polls ready() until it is true; fails early with the logs when a component has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [name for name, process in processes.items() if not process.alive()]
        if dead:
            raise ControlPlaneError(f"{', '.join(dead)} exited while waiting for {what}\n{log_tails(run_dir)}")
        time.sleep(0.25)
    raise ControlPlaneError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{log_tails(run_dir)}")


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
        return False


def _admin_tls(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


# ---------------------------------------------------------------------------------------------
# Start and stop


# Ports are picked free but bound later by the components, so another process may take one in
# between (other test runs start control planes on the same machine); such a start is retried.
START_ATTEMPTS = 3


def start(run_dir: Path, binaries: Path, timeout_s: float = 120.0, layout: Layout = FAKE_NODES) -> ControlPlane:
    """Starts a control plane in run_dir (created; must not exist) from the built folder
    `binaries` (see binaries_dir) and waits until its fake nodes are Ready (with real nodes: until
    it serves; the nodes join later).  On any failure it stops what it started and raises
    ControlPlaneError with the components' logs."""
    for attempt in range(1, START_ATTEMPTS + 1):
        run_dir.mkdir(parents=True)
        (run_dir / "logs").mkdir()
        processes: dict[str, ProcessId] = {}
        try:
            plane = _start_components(run_dir, binaries / "bin", binaries / "share", processes, timeout_s, layout)
        except ControlPlaneError as error:
            stop(run_dir, remove=False)  # every launch was recorded, so this stops exactly those
            if "address already in use" not in str(error) or attempt == START_ATTEMPTS:
                raise
            log.warning("a port was taken while starting (attempt %d); starting again", attempt)
            shutil.rmtree(run_dir)
            continue
        except BaseException:
            stop(run_dir, remove=False)
            raise
        log.info("control plane up in %s (%s)", run_dir, plane.server)
        return plane
    raise AssertionError("unreachable: the last attempt returns or raises")


def _record(
    run_dir: Path, bin_dir: Path, share_dir: Path, server: str, processes: dict[str, ProcessId], layout: Layout
) -> ControlPlane:
    """Writes state.json after every launch, so a failure at any point can stop what runs."""
    plane = ControlPlane(run_dir, bin_dir, share_dir, server, dict(processes), layout)
    state = {
        "run_dir": str(run_dir),
        "bin_dir": str(bin_dir),
        "share_dir": str(share_dir),
        "server": server,
        "processes": {name: process.to_json() for name, process in processes.items()},
        "layout": dataclasses.asdict(layout),
    }
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    return plane


def _start_components(
    run_dir: Path, bin_dir: Path, share_dir: Path, processes: dict[str, ProcessId], timeout_s: float, layout: Layout
) -> ControlPlane:
    pki = run_dir / "pki"
    generate_pki(pki, layout)
    etcd_port, etcd_peer_port, apiserver_port = free_port(), free_port(), free_port(layout.address)
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    server = f"https://{layout.address}:{apiserver_port}"
    kubeconfig = run_dir / "admin.kubeconfig"
    write_client_kubeconfig(kubeconfig, server, pki, "admin")

    def start_component(name: str, *args: str) -> None:
        processes[name] = launch([str(bin_dir / name), *args], run_dir / "logs" / f"{name}.log")
        _record(run_dir, bin_dir, share_dir, server, processes, layout)

    start_component(
        "etcd", "--name=test", f"--data-dir={run_dir / 'etcd'}", "--unsafe-no-fsync", "--log-level=warn",
        f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
        f"--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}",
        f"--initial-cluster=test=http://127.0.0.1:{etcd_peer_port}",
    )  # fmt: skip
    wait_until("etcd", lambda: _http_ok(f"{etcd_url}/health"), timeout_s, run_dir, processes)

    if layout.real_nodes:
        node_flags = [
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        ]  # fmt: skip
    else:
        # A loopback advertise address makes the `kubernetes` Endpoints reconciler log errors.
        node_flags = ["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]
    start_component(
        "kube-apiserver", f"--etcd-servers={etcd_url}",
        f"--bind-address={layout.address}", f"--advertise-address={layout.address}", f"--secure-port={apiserver_port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}", f"--cert-dir={pki}", *node_flags,
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={layout.service_cidr}", "--allow-privileged=true",
        "--enable-priority-and-fairness=false", "--profiling=false", "--kubelet-preferred-address-types=InternalIP",
    )  # fmt: skip
    tls = _admin_tls(pki)
    wait_until("kube-apiserver /readyz", lambda: _http_ok(f"{server}/readyz", tls), timeout_s, run_dir, processes)

    # secure-port=0: neither serves anything, so they open no port at all.
    # Real nodes get their pod ranges from the controller-manager (the node's CNI serves the same one).
    node_cidrs = ["--allocate-node-cidrs=true", f"--cluster-cidr={layout.pod_cidr}", "--node-cidr-mask-size=24"]
    start_component(
        "kube-controller-manager", f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", "--secure-port=0", f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
        *(node_cidrs if layout.real_nodes else []),
    )  # fmt: skip
    start_component(
        "kube-scheduler", f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", "--secure-port=0",
    )  # fmt: skip
    if not layout.real_nodes:
        stages = run_dir / "kwok-stages.yaml"
        stage_files = [share_dir / "kwok-stages.yaml", *sorted(STAGES_DIR.glob("*.yaml"))]
        stages.write_text("\n---\n".join(path.read_text() for path in stage_files))
        # kwok opens no port without --server-address / --node-port.
        start_component(
            "kwok", f"--kubeconfig={kubeconfig}", f"--config={stages}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--manage-nodes-with-label-selector=", "--manage-single-node=",
            f"--cidr={layout.pod_cidr}", f"--node-ip={NODE_IP}", "--node-lease-duration-seconds=40",
        )  # fmt: skip
    # The service-account controller creating `default` shows the controller-manager works.
    wait_until(
        "the controller-manager (default ServiceAccount)",
        lambda: _http_ok(f"{server}/api/v1/namespaces/default/serviceaccounts/default", tls),
        timeout_s,
        run_dir,
        processes,
    )
    plane = _record(run_dir, bin_dir, share_dir, server, processes, layout)
    if not layout.real_nodes:
        plane.kubectl("create", "-f", str(NODES_MANIFEST))
        plane.kubectl("wait", "--for=condition=Ready", "node", "--all", f"--timeout={int(timeout_s)}s")
    return plane


def load(run_dir: Path) -> ControlPlane:
    """The control plane recorded in run_dir (raises ControlPlaneError when there is none)."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as error:
        raise ControlPlaneError(f"no control plane recorded in {run_dir}: {error}") from error
    return ControlPlane(
        run_dir=Path(state["run_dir"]),
        bin_dir=Path(state["bin_dir"]),
        share_dir=Path(state["share_dir"]),
        server=state["server"],
        processes={name: ProcessId.from_json(value) for name, value in state["processes"].items()},
        layout=Layout(**state["layout"]) if "layout" in state else FAKE_NODES,
    )


def running(plane: ControlPlane) -> bool:
    """Every recorded component still runs."""
    return set(plane.processes) == set(plane.layout.components) and all(
        process.alive() for process in plane.processes.values()
    )


def stop(run_dir: Path, *, remove: bool = True) -> None:
    """Stops exactly the processes recorded in run_dir (SIGTERM, then SIGKILL after a grace
    period), then removes run_dir unless remove=False.  Safe to call twice."""
    with contextlib.suppress(ControlPlaneError):
        plane = load(run_dir)
        # One at a time, clients first: an API server whose etcd is already gone spends its whole
        # grace period retrying instead of exiting.
        for name in reversed(COMPONENTS):
            if name in plane.processes:
                terminate({name: plane.processes[name]}, STOP_GRACE_S)
    if remove:
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Command line (tests/k8s/infra/up and down call this)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("up", "down"))
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[k8s] %(message)s", stream=sys.stderr)
    run_dir = args.run_dir.resolve()
    if args.command == "down":
        stop(run_dir)
        return 0
    if run_dir.exists():
        with contextlib.suppress(ControlPlaneError):
            if running(load(run_dir)):
                parser.exit(1, f"a control plane already runs in {run_dir}; stop it with down first\n")
        stop(run_dir)  # leftovers of a crashed run: stop what still runs, start afresh
    try:
        plane = start(run_dir, binaries_dir(build=True))
    except ControlPlaneError as error:
        parser.exit(1, f"{error}\n")
    sys.stdout.write(
        f"export KUBECONFIG={plane.kubeconfig}\nexport PATH={plane.bin_dir}:$PATH\n"
        f"export M3STACK_K8S_RUN_DIR={plane.run_dir}\nexport M3STACK_K8S_SHARE={plane.share_dir}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
