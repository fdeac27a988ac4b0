"""What the real test node changes on this machine, and how each change is undone.

The node's addresses come from documentation and benchmarking blocks that this machine does not use
(eth0 here is 192.0.2.2/24 with its gateway at 192.0.2.1, so TEST-NET-1 is taken): the node is
198.51.100.1 on a sink interface, pods get 198.18.0.0/16 (this node 198.18.0.0/24, on a bridge the
CNI plugin creates), Services 198.19.0.0/16.  Every one of these ranges is routed into the sink
interface, where packets nobody answers are dropped: nothing in them can leave the machine through
the default route, and pods get routes to these ranges only (no default route, no masquerade).
The sink is an ifb device (it drops whatever is sent to it unless tc redirects it): the kernel here
loads no modules and has no `dummy` driver built in.

Everything here runs as root and assumes one real node per machine at a time (kube-proxy's iptables
chains have fixed names): `machine_owner` serialises that.  Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from controlplane import Layout
from processes import ProcessId

log = logging.getLogger("m3stack.k8s.node_host")

NODE_INTERFACE = "m3s-node0"  # ifb: the node's address, and the sink of every range below
BRIDGE = "m3s-cni0"  # created by the CNI bridge plugin for the first pod
NODE_CIDR = "198.51.100.0/24"
NODE_IP = "198.51.100.1"
POD_CIDR = "198.18.0.0/16"
NODE_POD_CIDR = "198.18.0.0/24"  # the first /24 the controller-manager allocates, served by the CNI config
POD_GATEWAY = "198.18.0.1"  # the bridge's address
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"
DNS_SERVICE_IP = "198.19.0.10"
LAYOUT = Layout(
    address=NODE_IP,
    service_cidr=SERVICE_CIDR,
    kubernetes_service_ip=KUBERNETES_SERVICE_IP,
    pod_cidr=POD_CIDR,
    real_nodes=True,
)
OUR_RANGES = (NODE_CIDR, POD_CIDR, SERVICE_CIDR)


def ours(address: str) -> bool:
    """True for an address of the real node's ranges: the only ones (with loopback) tests may connect to."""
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(address)
        return ip.is_loopback or any(ip in ipaddress.ip_network(cidr) for cidr in OUR_RANGES)
    return False


# Debian packages, by a file each provides.  The images need podman, buildah and mmdebstrap
# (images/build.py installs those itself).
PACKAGES = {
    "/usr/bin/containerd": "containerd",
    "/usr/sbin/runc": "runc",
    "/usr/sbin/iptables": "iptables",
    "/usr/sbin/conntrack": "conntrack",
    "/usr/bin/socat": "socat",
    "/usr/sbin/ipset": "ipset",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/bin/gcc": "gcc",
    "/usr/lib/x86_64-linux-gnu/libc.a": "libc6-dev",
}

# Kernel settings the kubelet, kube-proxy and the CNI plugins may change; put back when the node stops.
SYSCTLS = (
    "kernel.panic",
    "kernel.panic_on_oops",
    "vm.overcommit_memory",
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)

# iptables chains of kube-proxy (KUBE-), the kubelet (KUBE-KUBELET-CANARY, ...) and the CNI portmap
# plugin (CNI-); nothing else on a test machine uses these prefixes.
CHAIN_PREFIXES = ("KUBE-", "CNI-")
OWNER_DIR = Path("/run/m3stack-real-node")


class NodeError(RuntimeError):
    """The real node could not be set up, started or reached; the message says why."""


def run(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and result.returncode != 0:
        raise NodeError(f"{shlex.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def require_root() -> None:
    if os.geteuid() != 0:
        raise NodeError("the real node needs root (containerd, kubelet, network interfaces, iptables)")


def ensure_packages() -> None:
    """apt-get installs the Debian packages the node needs when any is missing (seconds when none is)."""
    missing = sorted({package for path, package in PACKAGES.items() if not Path(path).exists()})
    if not missing:
        return
    log.info("installing Debian packages: %s", " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise NodeError(f"apt-get install {' '.join(missing)} failed: {result.stderr.strip()[-2000:]}")


# ---------------------------------------------------------------------------------------------
# One real node per machine


@contextlib.contextmanager
def _owner_lock() -> Iterator[None]:
    OWNER_DIR.mkdir(parents=True, exist_ok=True)
    with open(OWNER_DIR / "lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def _owner_record() -> dict:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return json.loads((OWNER_DIR / "owner.json").read_text())
    return {}


def current_owner() -> Path | None:
    """The run folder of the real node this machine runs (or ran and did not clean up), if any."""
    record = _owner_record()
    return Path(record["run_dir"]) if "run_dir" in record else None


def _claimant_alive() -> bool:
    """The process that claimed the machine still runs: it may be starting its node (not yet running)."""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return ProcessId.from_json(_owner_record()["claimant"]).alive()
    return False


def claim_machine(
    run_dir: Path, alive: Callable[[Path], bool], cleanup: Callable[[Path], None], timeout_s: float
) -> None:
    """Records run_dir as the machine's real node.  While another recorded node is alive (alive(dir)
    is true) or the process that claimed it still runs (it may be starting it), it waits, up to
    timeout_s; a recorded node that is neither is cleaned up first (cleanup(dir): a run that
    crashed or was killed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _owner_lock():
            owner = current_owner()
            if owner is not None and owner != run_dir and not _claimant_alive() and not alive(owner):
                log.warning("cleaning up the real node a previous run left in %s", owner)
                cleanup(owner)
                owner = None
            if owner is None or owner == run_dir:
                record = {"run_dir": str(run_dir), "claimant": ProcessId.current().to_json()}
                (OWNER_DIR / "owner.json").write_text(json.dumps(record))
                return
        if time.monotonic() > deadline:
            raise NodeError(
                f"another real test node runs on this machine ({owner}) for more than {timeout_s:.0f}s; "
                "one machine runs one real node at a time (stop a node started by hand with "
                f"`tests/k8s/infra/realnode down {owner}`)"
            )
        time.sleep(5)


def release_machine(run_dir: Path) -> None:
    with _owner_lock():
        if current_owner() == run_dir:
            (OWNER_DIR / "owner.json").unlink()


# ---------------------------------------------------------------------------------------------
# Kernel settings


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = Path("/proc/sys", *name.split(".")).read_text().strip()
    return values


def restore_sysctls(saved: dict[str, str]) -> None:
    for name, value in saved.items():
        path = Path("/proc/sys", *name.split("."))
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                log.info("restoring %s = %s", name, value)
                path.write_text(value)


# ---------------------------------------------------------------------------------------------
# Network


def _routes_in_use() -> list[tuple[ipaddress.IPv4Network, str]]:
    routes = json.loads(run("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]")
    found = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("default", "") or route.get("type") in ("local", "broadcast"):
            continue
        with contextlib.suppress(ValueError):
            found.append((ipaddress.ip_network(dst, strict=False), route.get("dev", "")))
    return found


def setup_network() -> None:
    """The sink interface with the node's address, and routes that sink the pod and Service ranges
    into it.  Refuses when any of these ranges is already routed elsewhere on this machine."""
    ours = [ipaddress.ip_network(cidr) for cidr in OUR_RANGES]
    for network, dev in _routes_in_use():
        if dev not in (NODE_INTERFACE, BRIDGE) and any(network.overlaps(mine) for mine in ours):
            raise NodeError(f"{network} (dev {dev}) overlaps the real node's ranges {', '.join(OUR_RANGES)}")
    run("ip", "link", "add", NODE_INTERFACE, "type", "ifb")
    run("ip", "addr", "add", f"{NODE_IP}/24", "dev", NODE_INTERFACE)
    run("ip", "link", "set", NODE_INTERFACE, "up")
    for cidr in (POD_CIDR, SERVICE_CIDR):
        run("ip", "route", "add", cidr, "dev", NODE_INTERFACE)


def teardown_network() -> None:
    """Removes the sink interface (its routes go with it) and the CNI bridge."""
    for interface in (BRIDGE, NODE_INTERFACE):
        if Path("/sys/class/net", interface).exists():
            run("ip", "link", "delete", interface, check=False)


def remove_iptables_chains() -> None:
    """Deletes every rule that jumps to a KUBE-/CNI- chain, then those chains (IPv4 and IPv6)."""
    for command in ("iptables", "ip6tables"):
        if shutil.which(command) is None:
            continue
        for table in ("filter", "nat", "mangle", "raw"):
            listing = run(command, "-w", "-t", table, "-S", check=False)
            if listing.returncode != 0:
                continue
            chains = [line.split()[1] for line in listing.stdout.splitlines() if line.startswith("-N ")]
            ours = [chain for chain in chains if chain.startswith(CHAIN_PREFIXES)]
            if not ours:
                continue
            for line in listing.stdout.splitlines():
                words = shlex.split(line)
                if words[0] == "-A" and not words[1].startswith(CHAIN_PREFIXES) and _jumps_to(words, ours):
                    run(command, "-w", "-t", table, "-D", *words[1:], check=False)
            for chain in ours:
                run(command, "-w", "-t", table, "-F", chain, check=False)
            for chain in ours:
                run(command, "-w", "-t", table, "-X", chain, check=False)


def _jumps_to(words: list[str], chains: list[str]) -> bool:
    return any(flag in ("-j", "-g") and target in chains for flag, target in itertools.pairwise(words))


# ---------------------------------------------------------------------------------------------
# Containers, mounts, cgroups


def kill_pod_processes(containerd_socket: Path) -> None:
    """SIGKILL to every process in the kubelet's pod cgroups and to the containerd shims of this node
    (found by their -address argument): what an orderly stop left running."""
    victims: set[int] = set()
    for procs in Path("/sys/fs/cgroup").glob("*/kubepods/**/cgroup.procs"):
        with contextlib.suppress(OSError):
            victims.update(int(pid) for pid in procs.read_text().split())
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if args and args[0].endswith(b"containerd-shim-runc-v2") and str(containerd_socket).encode() in args:
                victims.add(int(cmdline.parent.name))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if victims:
        log.info("killed %d pod and shim processes", len(victims))


def remove_pod_cgroups() -> None:
    """rmdir the kubelet's pod cgroup trees (deepest first); they are empty once their processes are gone."""
    for _ in range(50):
        for top in Path("/sys/fs/cgroup").glob("*/kubepods"):
            for folder, _dirs, _files in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
        if not any(Path("/sys/fs/cgroup").glob("*/kubepods")):
            return
        time.sleep(0.1)
    log.warning("pod cgroups still present: %s", [str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods")])


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces and the like octal-escaped.
        points.append(line.split()[4].encode().decode("unicode_escape"))
    return points


def unmount_below(*roots: Path) -> None:
    """Unmounts everything mounted at or below the given folders (volumes, rootfs overlays, shm,
    network namespaces), deepest first; a busy mount is detached lazily."""
    prefixes = [str(root.resolve()) for root in roots]
    for point in sorted(set(_mount_points()), key=len, reverse=True):
        below = any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes)
        if below and run("umount", point, check=False).returncode != 0:
            run("umount", "--lazy", point, check=False)
