"""The real node's container runtime: containerd's configuration, images without a registry.

Images reach containerd as docker-archive tarballs (`ctr images import`): the project's own from
`scripts/dev images`, and the node's single-binary images (pause, CoreDNS, Traefik) written here
from the binaries `build --node` compiled, each one file on an empty base (FROM scratch).
containerd's root (image content and unpacked layers) is a cache kept between runs in
$M3STACK_CACHE/k8s/containerd-<version>, so an unchanged image is not imported again; its state
(sockets, running containers, network namespaces) lives in the run folder and goes with it.
Standard library only.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
from pathlib import Path

import node_host
from node_host import NodeError, run

log = logging.getLogger("m3stack.k8s.node_runtime")

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
SCRATCH_REPOSITORY = "localhost/m3stack-test"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins


def containerd_version() -> str:
    # "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3"
    return run("containerd", "--version").stdout.split()[2].split("~")[0]


def containerd_root() -> Path:
    cache = Path(os.environ.get("M3STACK_CACHE", Path.home() / ".cache" / "m3stack"))
    return cache / "k8s" / f"containerd-{containerd_version()}"


def containerd_config(root: Path, state: Path, socket: Path, cni_conf_dir: Path, sandbox_image: str) -> str:
    """containerd 1.6's configuration (format 2) for this machine: cgroupfs (no systemd), runc (crun
    refuses the hybrid cgroups here), overlayfs, restrict_oom_score_adj (no CAP_SYS_RESOURCE),
    Debian's CNI plugins, the locally built pause image, network namespaces under the state folder."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "/usr/sbin/runc"
  Root = "{state / "runc"}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{cni_conf_dir}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"
"""


def cni_config(ipam_dir: Path) -> str:
    """A bridge network for this node's pods: routes to the node's, pods' and Services' ranges only
    (no default route), no masquerade, hairpin for a pod reaching itself through a Service, host
    ports (portmap)."""
    config = {
        "cniVersion": "0.4.0",
        "name": "m3stack-test",
        "plugins": [
            {
                "type": "bridge",
                "bridge": node_host.BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node_host.NODE_POD_CIDR, "gateway": node_host.POD_GATEWAY}]],
                    "routes": [{"dst": cidr} for cidr in node_host.OUR_RANGES],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(config, indent=2) + "\n"


class Ctr:
    """containerd's own client, `ctr`, in the CRI plugin's namespace of one containerd."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def __call__(self, *args: str, check: bool = True) -> str:
        return run("ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args, check=check).stdout

    def serving(self) -> bool:
        return run("ctr", "--address", str(self.socket), "version", check=False).returncode == 0

    def images(self) -> set[str]:
        return set(self("images", "list", "--quiet").split())

    def import_archive(self, archive: Path) -> None:
        self("images", "import", str(archive))

    def remove_images_except(self, keep: set[str]) -> None:
        """Removes images no longer wanted (older builds), so the cached root does not grow without end."""
        stale = sorted(image for image in self.images() - keep if not image.startswith("sha256:"))
        if stale:
            log.info("removing %d stale images from containerd: %s", len(stale), " ".join(stale))
            self("images", "remove", *stale, check=False)


def scratch_image_reference(name: str, binary: Path) -> str:
    """A tag that changes exactly when the binary does."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:12]
    return f"{SCRATCH_REPOSITORY}/{name}:{digest}"


def write_scratch_image(archive: Path, reference: str, binary: Path, entrypoint: list[str]) -> None:
    """A docker-archive tarball of one image holding only `binary` at /<its name> (as FROM scratch)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tar.gettarinfo(str(binary), arcname=binary.name)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.mode = 0o755
        with open(binary, "rb") as data:
            tar.addfile(info, data)
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Entrypoint": entrypoint},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
    }
    config_bytes = json.dumps(config).encode()
    config_id = hashlib.sha256(config_bytes).hexdigest()
    manifest = [{"Config": f"{config_id}.json", "RepoTags": [reference], "Layers": [f"{diff_id}/layer.tar"]}]
    with tarfile.open(archive, mode="w") as outer:
        for name, data in (
            (f"{diff_id}/layer.tar", layer_bytes),
            (f"{config_id}.json", config_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            outer.addfile(info, io.BytesIO(data))


def import_scratch_image(ctr: Ctr, name: str, binary: Path, entrypoint: list[str]) -> str:
    """Imports the binary's image unless containerd has it; returns its reference."""
    reference = scratch_image_reference(name, binary)
    if reference not in ctr.images():
        with tempfile.TemporaryDirectory() as scratch:
            archive = Path(scratch) / f"{name}.tar"
            write_scratch_image(archive, reference, binary, entrypoint)
            ctr.import_archive(archive)
    return reference


def import_project_images(ctr: Ctr, manifest_path: Path) -> dict[str, str]:
    """Imports the engine, gateway and operator archives `scripts/dev images` wrote, each unless
    containerd already holds its exact reference; returns name -> reference."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise NodeError(f"cannot read the images manifest {manifest_path}: {error}") from error
    present = ctr.images()
    references = {}
    for name, image in manifest["images"].items():
        if not set(image["tags"]) <= present:
            log.info("importing %s (%.1f GB) into containerd", image["reference"], image["size_bytes"] / 1e9)
            ctr.import_archive(Path(image["archive"]))
        references[name] = image["reference"]
    return references


def manifest_tags(manifest_path: Path) -> set[str]:
    manifest = json.loads(manifest_path.read_text())
    return {tag for image in manifest["images"].values() for tag in image["tags"]}
