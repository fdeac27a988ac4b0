"""Build the engine, gateway and operator images from this repository without a registry: `scripts/dev images`.

    scripts/dev images                      build what changed; print the manifest's path
    scripts/dev images --print-manifest     print the manifest's path if it is current, else exit 1 (no build)
    scripts/dev images --device cuda        the engine for NVIDIA GPUs (FlashInfer, nvcc) instead of CPU

What it does, each step skipped when its result is already there:
1. installs Debian's podman, buildah, runc and mmdebstrap with apt-get when they are missing;
2. makes the base image from Debian's archive with mmdebstrap (bookworm, Python 3.11), cached as a tarball in
   ``$M3STACK_CACHE/images/base/<recipe-hash>/`` and imported with podman as
   ``localhost/m3stack/base:<recipe-hash>-<rootfs-digest>``;
3. builds ``images/<name>.Dockerfile`` with ``BASE_IMAGE`` set to that base, tagged
   ``localhost/m3stack/<name>:<version>`` and ``localhost/m3stack/<name>:<version>-<inputs-hash>``, where the hash
   covers the Dockerfile, its build arguments, the base and every file it copies: an image is rebuilt only when
   one of those changed (and then podman's layer cache keeps torch's layer unless the torch arguments changed);
4. writes each image as a docker-archive tarball, and the manifest, into ``$M3STACK_CACHE/images/v1/``.

The manifest (``v1/manifest.json``, the interface other scripts rely on; images/README.md)::

    {"format": 1, "version": "0.1.0",
     "images": {"engine": {"reference": "localhost/m3stack/engine:0.1.0-<hash>",
                           "tags": ["localhost/m3stack/engine:0.1.0", "localhost/m3stack/engine:0.1.0-<hash>"],
                           "archive": "/.../images/v1/engine-<hash>.tar", "inputs": "<hash>", "device": "cpu",
                           "size_bytes": ..., "build_seconds": ...},
                "gateway": {...}, "operator": {...}}}

Each archive carries both tags; ``ctr -n k8s.io images import ARCHIVE`` puts them in containerd.  Podman runs with
the settings this kind of VM needs, from a containers.conf this script writes (CONTAINERS_CONF): runc, cgroupfs,
raised ulimits; builds use the host network and mount the host's CA bundle (never baked into an image) and a uv
download cache under ``$M3STACK_CACHE/images/uv``.  One build at a time (a lock); progress goes to stderr, the
tools' output to ``$M3STACK_CACHE/images/build.log``.
"""

import argparse
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("images")

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ("engine", "gateway", "operator")
REPOSITORY = "localhost/m3stack"
# Bump when the folder layout or the manifest changes meaning; other scripts read v<LAYOUT>/manifest.json.
LAYOUT = 1
MANIFEST_FORMAT = 1
DEVICES = ("cpu", "cuda")

# The base: what python:3.11-slim-bookworm gives the Dockerfiles (python3 with venv, CA certificates, useradd).
DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
# Documentation, manuals and translations are never read in a container.
BASE_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")
BASE_CONFIG = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
               'CMD ["python3"]')  # fmt: skip
HOST_PACKAGES = {"podman": "podman", "buildah": "buildah", "runc": "runc", "mmdebstrap": "mmdebstrap"}

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
UV_CACHE_IN_BUILD = "/var/cache/uv"
# What this VM kind needs (shared/research/real_nodes.md): crun fails on its hybrid cgroups, there is no
# systemd, and the default open-file and process limits are above what a container may ask for here.
CONTAINERS_CONF = """\
# Written by images/build: podman settings for building and running m3stack's images on this machine.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# What .dockerignore keeps out of the build context among the folders the Dockerfiles copy.
IGNORED_PARTS = ("__pycache__",)
IGNORED_SUFFIXES = (".pyc",)


class BuildError(RuntimeError):
    """A step failed; the message says which and where its output is."""


@dataclass(frozen=True)
class Paths:
    cache: Path

    @property
    def images(self) -> Path:
        return self.cache / "images"

    @property
    def output(self) -> Path:
        return self.images / f"v{LAYOUT}"

    @property
    def manifest(self) -> Path:
        return self.output / "manifest.json"

    @property
    def uv_cache(self) -> Path:
        return self.images / "uv"

    @property
    def containers_conf(self) -> Path:
        return self.images / "containers.conf"

    @property
    def log(self) -> Path:
        return self.images / "build.log"

    def base_dir(self, key: str) -> Path:
        return self.images / "base" / key


@dataclass(frozen=True)
class Plan:
    """One image to have: its name, build arguments (besides BASE_IMAGE) and inputs hash."""

    name: str
    build_args: dict[str, str]
    inputs: str
    version: str  # of the tags: the project's version, plus the device for a GPU engine

    @property
    def reference(self) -> str:
        return f"{REPOSITORY}/{self.name}:{self.version}-{self.inputs}"

    @property
    def tags(self) -> list[str]:
        return [f"{REPOSITORY}/{self.name}:{self.version}", self.reference]

    def archive(self, paths: Paths) -> Path:
        return paths.output / f"{self.name}-{self.inputs}.tar"


def project_version(root: Path = ROOT) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def base_key() -> str:
    """The base recipe's hash: a new package list or setting makes a new base folder and tag."""
    recipe = {"suite": DEBIAN_SUITE, "packages": BASE_PACKAGES, "excludes": BASE_EXCLUDES, "config": BASE_CONFIG}
    return _digest(json.dumps(recipe, sort_keys=True).encode())


def copied_sources(dockerfile: str) -> list[str]:
    """The build-context paths a Dockerfile copies (COPY without --from; the last word is the destination)."""
    sources: list[str] = []
    for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.MULTILINE):
        sources += [word for word in shlex.split(line)[:-1] if not word.startswith("--")]
    return sources


def context_files(root: Path, sources: list[str]) -> Iterator[Path]:
    """Every file those sources put in the image, sorted, without what .dockerignore drops from them."""
    files: set[Path] = set()
    for source in sources:
        path = root / source
        if not path.exists():
            raise BuildError(f"COPY {source}: no such file or folder in {root}")
        candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for candidate in candidates:
            relative = candidate.relative_to(root)
            if any(part in IGNORED_PARTS for part in relative.parts) or candidate.suffix in IGNORED_SUFFIXES:
                continue
            files.add(relative)
    yield from sorted(files)


def inputs_hash(root: Path, name: str, build_args: dict[str, str], base_digest: str) -> str:
    """What decides an image's content: its Dockerfile, build arguments, base and the files it copies."""
    dockerfile = (root / "images" / f"{name}.Dockerfile").read_text()
    hasher = hashlib.sha256()
    header = {"dockerfile": dockerfile, "args": build_args, "base": base_digest, "layout": LAYOUT}
    hasher.update(json.dumps(header, sort_keys=True).encode())
    for relative in context_files(root, copied_sources(dockerfile)):
        hasher.update(f"\0{relative.as_posix()}\0".encode())
        hasher.update(hashlib.sha256((root / relative).read_bytes()).digest())
    return hasher.hexdigest()[:12]


def plans(root: Path, version: str, device: str, base_digest: str) -> list[Plan]:
    result = []
    for name in IMAGES:
        build_args = {"VERSION": version, **({"DEVICE": device} if name == "engine" else {})}
        # The GPU engine is another image than the CPU one: its own tags (0.1.0-cuda).
        tag_version = f"{version}-{device}" if name == "engine" and device != "cpu" else version
        result.append(Plan(name, build_args, inputs_hash(root, name, build_args, base_digest), tag_version))
    return result


def manifest_entry(plan: Plan, paths: Paths, device: str, size_bytes: int, build_seconds: float | None) -> dict:
    entry = {
        "reference": plan.reference,
        "tags": plan.tags,
        "archive": str(plan.archive(paths)),
        "inputs": plan.inputs,
        "size_bytes": size_bytes,
        "build_seconds": None if build_seconds is None else round(build_seconds, 1),
    }
    if plan.name == "engine":
        entry["device"] = device
    return entry


def current_manifest(paths: Paths, wanted: list[Plan]) -> Path | None:
    """The manifest's path when it lists exactly these images and their archives exist, else None."""
    try:
        manifest = json.loads(paths.manifest.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    images = manifest.get("images", {})
    for plan in wanted:
        entry = images.get(plan.name, {})
        if entry.get("reference") != plan.reference or not Path(entry.get("archive", "")).is_file():
            return None
    return paths.manifest


def recorded_base_digest(paths: Paths) -> str | None:
    digest_file = paths.base_dir(base_key()) / "rootfs.sha256"
    return digest_file.read_text().strip() if digest_file.is_file() else None


class Builder:
    """Runs the tools, logging their output to one file; every step is skipped when its result exists."""

    def __init__(self, paths: Paths, root: Path = ROOT):
        self.paths = paths
        self.root = root
        self.env = {**os.environ, "CONTAINERS_CONF": str(paths.containers_conf)}

    def run(self, *command: str, capture: bool = False) -> str:
        with self.paths.log.open("a") as log:
            log.write(f"\n$ {shlex.join(command)}\n")
            log.flush()
            result = subprocess.run(
                command, cwd=self.root, env=self.env, stdout=subprocess.PIPE if capture else log, stderr=log, text=True
            )
        if result.returncode != 0:
            raise BuildError(f"{shlex.join(command[:3])} ... failed (exit {result.returncode}); see {self.paths.log}")
        return result.stdout or ""

    def ensure_host_packages(self) -> None:
        missing = [package for command, package in HOST_PACKAGES.items() if shutil.which(command) is None]
        if not missing:
            return
        if os.geteuid() != 0:
            raise BuildError(f"missing {' '.join(missing)}: install them (apt-get install {' '.join(missing)}) as root")
        logger.info("installing Debian packages: %s", " ".join(missing))
        self.run("apt-get", "update", "-q")
        self.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing)

    def write_containers_conf(self) -> None:
        if not self.paths.containers_conf.is_file() or self.paths.containers_conf.read_text() != CONTAINERS_CONF:
            self.paths.containers_conf.write_text(CONTAINERS_CONF)

    def image_exists(self, reference: str) -> bool:
        result = subprocess.run(["podman", "image", "exists", reference], env=self.env, cwd=self.root)
        return result.returncode == 0

    def ensure_base(self) -> tuple[str, str]:
        """(reference, rootfs digest) of the base image, made and imported if needed."""
        key = base_key()
        folder = self.paths.base_dir(key)
        rootfs, digest_file = folder / "rootfs.tar", folder / "rootfs.sha256"
        if not digest_file.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            logger.info("making the base from Debian %s with mmdebstrap (%s)", DEBIAN_SUITE, ", ".join(BASE_PACKAGES))
            started = time.monotonic()
            partial = folder / "rootfs.tar.partial"
            self.run(
                "mmdebstrap",
                "--variant=minbase",
                "--format=tar",
                f"--include={','.join(BASE_PACKAGES)}",
                *(f"--dpkgopt=path-exclude={pattern}" for pattern in BASE_EXCLUDES),
                DEBIAN_SUITE,
                str(partial),
            )
            partial.rename(rootfs)
            digest_file.write_text(_file_digest(rootfs) + "\n")
            logger.info("base rootfs made in %.0f s (%s)", time.monotonic() - started, _size(rootfs.stat().st_size))
        digest = digest_file.read_text().strip()
        # The rootfs digest in the tag too: another cache's base made from the same recipe holds other bytes.
        reference = f"{REPOSITORY}/base:{key}-{digest[:12]}"
        if not self.image_exists(reference):
            logger.info("importing the base as %s", reference)
            self.run("podman", "import", *(f"--change={line}" for line in BASE_CONFIG), str(rootfs), reference)
        return reference, digest

    def build(self, plan: Plan, base: str) -> float | None:
        """Builds the image unless its inputs-hash tag exists; returns the seconds it took (None: skipped)."""
        if self.image_exists(plan.reference):
            logger.info("%s is current (%s)", plan.name, plan.reference)
            self.run("podman", "tag", plan.reference, *plan.tags)  # the version tag may point at another build
            return None
        logger.info("building %s (%s)", plan.name, plan.reference)
        self.paths.uv_cache.mkdir(parents=True, exist_ok=True)
        args = {"BASE_IMAGE": base, **plan.build_args, "UV_NO_CACHE": "0", "UV_CACHE_DIR": UV_CACHE_IN_BUILD}
        volumes = [f"{self.paths.uv_cache}:{UV_CACHE_IN_BUILD}"]
        if HOST_CA_BUNDLE.is_file():  # a TLS-intercepting proxy's CA: mounted for the build, never in a layer
            volumes.append(f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro")
            args |= {"PIP_CERT": str(HOST_CA_BUNDLE), "SSL_CERT_FILE": str(HOST_CA_BUNDLE)}
        started = time.monotonic()
        self.run(
            "podman",
            "build",
            "--network=host",
            "--pull=never",
            "--layers",
            f"--file=images/{plan.name}.Dockerfile",
            *(f"--build-arg={key}={value}" for key, value in args.items()),
            *(f"--volume={volume}" for volume in volumes),
            *(f"--tag={tag}" for tag in plan.tags),
            ".",
        )
        seconds = time.monotonic() - started
        logger.info("built %s in %.0f s", plan.name, seconds)
        return seconds

    def save(self, plan: Plan) -> None:
        archive = plan.archive(self.paths)
        if archive.is_file():
            return
        started = time.monotonic()
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        self.run("podman", "save", "--format=docker-archive", "--multi-image-archive", f"--output={partial}",
                 *plan.tags)  # fmt: skip
        partial.rename(archive)
        logger.info("wrote %s (%s) in %.0f s", archive, _size(archive.stat().st_size), time.monotonic() - started)

    def remove_older_builds(self, plan: Plan) -> None:
        """Untags earlier builds of this image and device (layers the current one shares stay, so does
        podman's build cache); an image a container still runs is left alone."""
        listed = self.run("podman", "images", "--format={{.Repository}}:{{.Tag}}", f"{REPOSITORY}/{plan.name}",
                          capture=True)  # fmt: skip
        earlier = re.compile(rf"{re.escape(REPOSITORY)}/{plan.name}:{re.escape(plan.version)}-[0-9a-f]{{12}}")
        old = sorted({ref for ref in listed.split() if earlier.fullmatch(ref) and ref != plan.reference})
        if old:
            with self.paths.log.open("a") as log:
                subprocess.run(["podman", "rmi", *old], env=self.env, stdout=log, stderr=log)

    def image_size(self, reference: str) -> int:
        return int(self.run("podman", "image", "inspect", "--format={{.Size}}", reference, capture=True).strip())


def build_all(paths: Paths, device: str) -> Path:
    paths.output.mkdir(parents=True, exist_ok=True)
    builder = Builder(paths)
    builder.ensure_host_packages()
    builder.write_containers_conf()
    base, base_digest = builder.ensure_base()
    wanted = plans(builder.root, project_version(builder.root), device, base_digest)
    previous = _read_manifest(paths)
    images = {}
    for plan in wanted:
        seconds = builder.build(plan, base)
        builder.save(plan)
        builder.remove_older_builds(plan)
        if seconds is None:  # keep the figures of the build that made it
            seconds = previous.get(plan.name, {}).get("build_seconds") if _same(previous, plan) else None
        images[plan.name] = manifest_entry(plan, paths, device, builder.image_size(plan.reference), seconds)
    manifest = {"format": MANIFEST_FORMAT, "version": project_version(builder.root), "images": images}
    partial = paths.manifest.with_suffix(".partial")
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    partial.rename(paths.manifest)
    _remove_stale_archives(paths, {Path(entry["archive"]).name for entry in images.values()})
    return paths.manifest


def _read_manifest(paths: Paths) -> dict:
    try:
        return json.loads(paths.manifest.read_text()).get("images", {})
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _same(previous: dict, plan: Plan) -> bool:
    return previous.get(plan.name, {}).get("reference") == plan.reference


def _remove_stale_archives(paths: Paths, keep: set[str]) -> None:
    """Archives are gigabytes: only those the manifest lists stay."""
    for archive in paths.output.glob("*.tar"):
        if archive.name not in keep:
            archive.unlink()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/dev images", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="what the engine image runs on")
    parser.add_argument(
        "--print-manifest",
        action="store_true",
        help="print the manifest's path if it lists the images of this tree; exit 1 (building nothing) if not",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[images] %(message)s", stream=sys.stderr)
    paths = Paths(Path(os.environ.get("M3STACK_CACHE") or Path.home() / ".cache" / "m3stack").expanduser())
    if args.print_manifest:
        base_digest = recorded_base_digest(paths)
        wanted = plans(ROOT, project_version(), args.device, base_digest) if base_digest else []
        manifest = current_manifest(paths, wanted) if wanted else None
        if manifest is None:
            return 1
        sys.stdout.write(f"{manifest}\n")
        return 0
    paths.images.mkdir(parents=True, exist_ok=True)
    with (paths.images / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time: CI and shells may share the cache
        try:
            manifest = build_all(paths, args.device)
        except BuildError as error:
            logger.error("%s", error)
            return 1
    sys.stdout.write(f"{manifest}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
