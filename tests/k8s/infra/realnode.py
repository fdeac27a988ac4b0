"""A test cluster with one real node: its own control plane, containerd, kubelet, kube-proxy, CoreDNS
and Traefik, on addresses this machine creates for the run (node_host.py says which).

Its own control plane rather than the shared one: that one has kwok's fake nodes, where the
scheduler would place any pod without a node selector (the operator, the example's gateways), and
a pod on a fake node never runs.  Here the real node is the only node, so everything the chart and
the operator create really runs.  The API server binds to the node's address, which pods reach
through the `kubernetes` Service; the kubelet and kube-proxy authenticate with client certificates
(system:node:<name> under the Node authorizer, system:kube-proxy), and the kubelet serves its API
with a certificate the API server verifies, so `kubectl logs/exec/port-forward` work.

    python3 realnode.py up RUN_DIR     start (as root), print `export ...` lines for a shell
    python3 realnode.py down RUN_DIR   stop everything it started and undo every change to the host

Standard library only, like controlplane.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import controlplane
import node_host
import node_runtime
from controlplane import ControlPlane, ControlPlaneError
from node_host import NODE_IP, NodeError
from processes import ProcessId, launch, terminate

log = logging.getLogger("m3stack.k8s.realnode")

INFRA_DIR = Path(__file__).resolve().parent
ADDONS = INFRA_DIR / "addons.yaml"
NODE_NAME = "real-node-0"
NODE_STATE = "node.json"
# Start order; stopping goes in reverse.
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy")
KUBELET_PORT = 10250
INGRESS_PORT = 80
CLAIM_TIMEOUT_S = 1800.0
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class RealCluster:
    """A running control plane with one real node."""

    run_dir: Path
    plane: ControlPlane
    processes: dict[str, ProcessId]
    images: dict[str, str]  # engine, gateway, operator -> the reference `scripts/dev images` built
    node_name: str = NODE_NAME
    node_ip: str = NODE_IP

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd" / "containerd.sock"

    @property
    def ingress_url(self) -> str:
        return f"http://{self.node_ip}:{INGRESS_PORT}"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    def ctr(self) -> node_runtime.Ctr:
        return node_runtime.Ctr(self.containerd_socket)


# ---------------------------------------------------------------------------------------------
# State


def _write_state(run_dir: Path, **changes: object) -> None:
    path = run_dir / NODE_STATE
    state = json.loads(path.read_text()) if path.exists() else {}
    state.update(changes)
    path.write_text(json.dumps(state, indent=2) + "\n")


def _read_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / NODE_STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def load(run_dir: Path) -> RealCluster:
    state = _read_state(run_dir)
    if "images" not in state:
        raise NodeError(f"no started real node recorded in {run_dir}")
    return RealCluster(
        run_dir=run_dir,
        plane=controlplane.load(run_dir / "control-plane"),
        processes={name: ProcessId.from_json(value) for name, value in state["processes"].items()},
        images=state["images"],
    )


def running(run_dir: Path) -> bool:
    """The control plane and every node component of run_dir still run."""
    with contextlib.suppress(NodeError, ControlPlaneError):
        cluster = load(run_dir)
        return (
            controlplane.running(cluster.plane)
            and set(cluster.processes) == set(NODE_COMPONENTS)
            and all(process.alive() for process in cluster.processes.values())
        )
    return False


# ---------------------------------------------------------------------------------------------
# Start


def start(run_dir: Path, binaries: Path, node_binaries: Path, images_manifest: Path) -> RealCluster:
    """Starts the control plane and the node in run_dir (created; must not exist), imports the
    images, starts the add-ons and waits until all of them are ready.  On any failure it stops
    what it started, undoes its changes to the host, and raises NodeError with the logs."""
    node_host.require_root()
    node_host.ensure_packages()
    node_host.claim_machine(run_dir, running, lambda old: stop(old, release=False), CLAIM_TIMEOUT_S)
    run_dir.mkdir(parents=True)
    (run_dir / "logs").mkdir()
    _write_state(run_dir, sysctls=node_host.read_sysctls(), processes={})
    try:
        return _start(run_dir, binaries, node_binaries, images_manifest)
    except BaseException as error:
        # A ControlPlaneError already ends with the logs of the folder it waited on.
        logs = "" if isinstance(error, ControlPlaneError) else "\n" + controlplane.log_tails(run_dir, lines=20)
        stop(run_dir, remove=False)
        if isinstance(error, (NodeError, ControlPlaneError, subprocess.SubprocessError)):
            raise NodeError(f"the real node could not start: {error}{logs}") from error
        raise


def _start(run_dir: Path, binaries: Path, node_binaries: Path, images_manifest: Path) -> RealCluster:
    started = time.monotonic()
    node_host.setup_network()
    plane = controlplane.start(run_dir / "control-plane", binaries, layout=node_host.LAYOUT)
    processes: dict[str, ProcessId] = {}

    def start_component(name: str, *args: str) -> None:
        processes[name] = launch(list(args), run_dir / "logs" / f"{name}.log")
        _write_state(run_dir, processes={n: p.to_json() for n, p in processes.items()})

    # containerd, with the CNI configuration it loads at start.
    containerd_dir, cni_dir = run_dir / "containerd", run_dir / "cni"
    (containerd_dir / "state").mkdir(parents=True)
    cni_dir.mkdir()
    ctr = node_runtime.Ctr(containerd_dir / "containerd.sock")
    pause_image = node_runtime.scratch_image_reference("pause", node_binaries / "bin" / "pause")
    (cni_dir / "10-m3stack.conflist").write_text(node_runtime.cni_config(cni_dir / "ipam"))
    config = containerd_dir / "config.toml"
    config.write_text(
        node_runtime.containerd_config(
            node_runtime.containerd_root(), containerd_dir / "state", ctr.socket, cni_dir, pause_image
        )
    )
    start_component("containerd", "containerd", "--config", str(config))
    controlplane.wait_until("containerd", ctr.serving, 60, run_dir, processes)

    # Images: the node's own from the built binaries, the project's from `scripts/dev images`.
    bin_dir = node_binaries / "bin"
    node_runtime.import_scratch_image(ctr, "pause", bin_dir / "pause", ["/pause"])
    coredns = node_runtime.import_scratch_image(ctr, "coredns", bin_dir / "coredns", ["/coredns"])
    traefik = node_runtime.import_scratch_image(ctr, "traefik", bin_dir / "traefik", ["/traefik"])
    images = node_runtime.import_project_images(ctr, images_manifest)
    ctr.remove_images_except({pause_image, coredns, traefik} | node_runtime.manifest_tags(images_manifest))
    log.info("images ready in containerd after %.0f s", time.monotonic() - started)

    # kubelet and kube-proxy, each with its own client certificate.
    pki = plane.run_dir / "pki"
    kubelet_config = _kubelet_files(run_dir, plane, pki, ctr.socket)
    start_component(
        "kubelet", str(plane.binary("kubelet")), f"--config={kubelet_config}",
        f"--kubeconfig={run_dir / 'kubelet.kubeconfig'}", f"--root-dir={run_dir / 'kubelet'}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", "--v=1",
    )  # fmt: skip
    proxy_config = _kube_proxy_files(run_dir, plane, pki)
    start_component("kube-proxy", str(plane.binary("kube-proxy")), f"--config={proxy_config}", "--v=1")
    controlplane.wait_until("the node to register", lambda: _node_ready(plane), 120, run_dir, processes)
    log.info("node %s Ready after %.0f s", NODE_NAME, time.monotonic() - started)

    addons = string.Template(ADDONS.read_text()).substitute(
        COREDNS_IMAGE=coredns, TRAEFIK_IMAGE=traefik, DNS_SERVICE_IP=node_host.DNS_SERVICE_IP, NODE_IP=NODE_IP
    )
    plane.kubectl("apply", "-f", "-", input=addons)
    for namespace, name in (("kube-system", "coredns"), ("ingress", "traefik")):
        plane.kubectl("rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout=120s")
    _write_state(run_dir, images=images)
    log.info("real cluster ready in %.0f s (%s)", time.monotonic() - started, run_dir)
    return load(run_dir)


def _node_ready(plane: ControlPlane) -> bool:
    with contextlib.suppress(ControlPlaneError):
        node = json.loads(plane.kubectl("get", "node", NODE_NAME, "-o", "json"))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
    return False


def _kubelet_files(run_dir: Path, plane: ControlPlane, pki: Path, socket: Path) -> Path:
    """The kubelet's client and serving certificates, kubeconfig and configuration; returns the latter."""
    node_user = f"system:node:{NODE_NAME}"
    controlplane.issue_certificate(pki, "kubelet-client", f"/O=system:nodes/CN={node_user}", client=True)
    controlplane.issue_certificate(
        pki, "kubelet-serving", f"/O=system:nodes/CN={node_user}",
        server_names=[f"DNS:{NODE_NAME}", f"IP:{NODE_IP}"], client=False,
    )  # fmt: skip
    controlplane.write_client_kubeconfig(run_dir / "kubelet.kubeconfig", plane.server, pki, "kubelet-client")
    # Pods get the cluster DNS only; with an empty host resolv.conf nothing can be forwarded off the machine.
    (run_dir / "resolv.conf").write_text("")
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "containerRuntimeEndpoint": f"unix://{socket}",
        # cgroup v1 without systemd (the kubelet 1.36 refuses cgroup v1 unless told), no swap check.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [node_host.DNS_SERVICE_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(run_dir / "resolv.conf"),
        "volumePluginDir": str(run_dir / "volume-plugins"),
        # The project's images live only in this containerd: never collect them, and do not evict pods
        # because a shared development disk is fuller than a production node's would be.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }
    path = run_dir / "kubelet.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def _kube_proxy_files(run_dir: Path, plane: ControlPlane, pki: Path) -> Path:
    controlplane.issue_certificate(pki, "kube-proxy", "/CN=system:kube-proxy", client=True)
    controlplane.write_client_kubeconfig(run_dir / "kube-proxy.kubeconfig", plane.server, pki, "kube-proxy")
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(run_dir / "kube-proxy.kubeconfig")},
        "mode": "iptables",
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": node_host.POD_CIDR,
        # NodePorts on the node's address only, never on eth0; no NodePorts on loopback (that sets
        # route_localnet); conntrack sizes and timeouts left as the machine has them.
        "nodePortAddresses": [node_host.NODE_CIDR],
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "healthzBindAddress": f"127.0.0.1:{controlplane.free_port()}",
        "metricsBindAddress": f"127.0.0.1:{controlplane.free_port()}",
    }
    path = run_dir / "kube-proxy.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Stop


def stop(run_dir: Path, *, remove: bool = True, release: bool = True) -> None:
    """Stops everything recorded in run_dir and undoes the host changes: pods and their processes,
    mounts, pod cgroups, iptables chains, interfaces and routes, kernel settings; then gives up the
    machine (unless release=False: the caller holds its lock).  Safe to call twice, and on the
    leftovers of a run that was killed."""
    state = _read_state(run_dir)
    processes = {name: ProcessId.from_json(value) for name, value in state.get("processes", {}).items()}
    socket = run_dir / "containerd" / "containerd.sock"
    terminate({name: processes[name] for name in ("kube-proxy", "kubelet") if name in processes}, STOP_GRACE_S)
    node_host.kill_pod_processes(socket)
    if "containerd" in processes and processes["containerd"].alive():
        # Forget the containers (their processes are gone), so the cached root holds images only.
        ctr = node_runtime.Ctr(socket)
        for task in ctr("tasks", "list", "--quiet", check=False).split():
            ctr("tasks", "delete", "--force", task, check=False)
        containers = ctr("containers", "list", "--quiet", check=False).split()
        if containers:
            ctr("containers", "delete", *containers, check=False)
    terminate({name: p for name, p in processes.items() if name == "containerd"}, STOP_GRACE_S)
    node_host.unmount_below(run_dir)
    node_host.remove_pod_cgroups()
    controlplane.stop(run_dir / "control-plane", remove=False)
    # kube-proxy's own cleanup first (it knows its chains), then whatever KUBE-/CNI- chains remain.
    with contextlib.suppress(ControlPlaneError, OSError):
        binaries = controlplane.load(run_dir / "control-plane").bin_dir
        subprocess.run([str(binaries / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60)
    node_host.remove_iptables_chains()
    node_host.teardown_network()
    node_host.restore_sysctls(state.get("sysctls", {}))
    if release:
        node_host.release_machine(run_dir)
    if remove:
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Command line (tests/k8s/infra/realnode-up and -down call this)


def images_manifest() -> Path:
    """The manifest of the current tree's images; builds them first (`scripts/dev images`)."""
    root = INFRA_DIR.parents[2]
    result = subprocess.run([str(root / "scripts" / "dev"), "images"], stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise NodeError(f"scripts/dev images failed (exit {result.returncode}); its output says why")
    return Path(result.stdout.strip().splitlines()[-1])


def node_binaries_dir(*, build: bool = True) -> Path | None:
    """The folder `build --node` fills (pause, CoreDNS, Traefik); built first when build=True, else
    None when it is not complete."""
    args = ["bash", str(INFRA_DIR / "build"), "--node", *([] if build else ["--print-dir"])]
    result = subprocess.run(args, stdout=subprocess.PIPE, stderr=None if build else subprocess.DEVNULL, text=True)
    if result.returncode != 0:
        if not build:
            return None
        raise NodeError(f"{INFRA_DIR / 'build'} --node failed (exit {result.returncode}); its log says why")
    return Path(result.stdout.strip().splitlines()[-1])


def built_node_binaries() -> Path:
    folder = node_binaries_dir(build=True)
    assert folder is not None  # build=True raises instead
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("up", "down"))
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[real-node] %(message)s", stream=sys.stderr)
    run_dir = args.run_dir.resolve()
    if args.command == "down":
        stop(run_dir)
        return 0
    if running(run_dir):
        parser.exit(1, f"a real node already runs in {run_dir}; stop it with down first\n")
    stop(run_dir)  # leftovers of a crashed run
    try:
        cluster = start(
            run_dir, controlplane.binaries_dir(build=True), built_node_binaries(), images_manifest=images_manifest()
        )
    except (NodeError, ControlPlaneError) as error:
        parser.exit(1, f"{error}\n")
    sys.stdout.write(
        f"export KUBECONFIG={cluster.plane.kubeconfig}\nexport PATH={cluster.plane.bin_dir}:$PATH\n"
        f"export M3STACK_K8S_REAL_RUN_DIR={cluster.run_dir}\nexport CONTAINERD_ADDRESS={cluster.containerd_socket}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
