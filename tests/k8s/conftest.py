"""Fixtures for tests on the real Kubernetes test control plane (see tests/k8s/README.md).

- `k8s_cluster` (session): the running ControlPlane, shared by all pytest-xdist workers of the run
  and stopped after the last one; `.kubeconfig`, `.kubectl(...)`, `.run([...])`, `.popen([...])`,
  `.binary("helm")`, `.service_account_kubeconfig(...)`.
- `k8s_kubeconfig` (session): the admin kubeconfig path.
- `k8s_client` (session): a factory, `k8s_client(kubeconfig=None) -> kubernetes.client.ApiClient`.
- `k8s_namespace` (function): a fresh namespace for one test, deleted after it.
- `k8s_env` (function): KUBECONFIG and PATH (cached binaries first) set in os.environ for one test,
  for in-process clients such as kopf's KopfRunner.
- `k8s_node_pool` (function): a factory, `k8s_node_pool(count=1, gpus=8, product="NVIDIA-H200")
  -> NodePool`, fake GPU nodes only this test's pods use (`.node_selector`, `.toleration`).
- `k8s_real_cluster` (session): a RealCluster (infra/realnode.py), the cluster with one real node
  (containerd, kubelet, kube-proxy, CoreDNS, Traefik) and the project's images imported, shared by
  the run's workers and stopped after the last.  `.plane` (its ControlPlane: kubectl, helm, ...),
  `.images` ({"engine", "gateway", "operator"} -> the exact references `scripts/dev images` built;
  their `<version>` tags, the chart's defaults, are imported too), `.node_name`, `.node_ip`,
  `.ingress_url` (Traefik on the node address, port 80), `.run_dir`, `.logs_dir` (containerd,
  kubelet, kube-proxy logs), `.containerd_socket`, `.ctr()`.  Tests under tests/k8s/realnode use it;
  they run on one xdist worker, one after another.  Connect only to addresses for which
  `node_host.ours(address)` is true (the node's, pods' and Services' ranges, and loopback).
- `k8s_real_namespace` (function): a fresh namespace on that cluster, deleted (and waited for, up to
  300 s) after.  Delete your workloads and wait for their pods first: the namespace controller finishes
  a namespace deleted while a pod terminates only after that pod's whole grace period (330 s for an
  engine with the default drain), however soon the pod stops.

A control plane that cannot be built or started fails every test that uses it, with the reason
and the components' logs; nothing is skipped.  Set M3STACK_K8S_RUN_DIR to the folder of a control
plane started with tests/k8s/infra/up to reuse it (it is then left running); likewise
M3STACK_K8S_REAL_RUN_DIR for a real-node cluster started with `infra/realnode.py up RUN_DIR`.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

sys.path.insert(0, str(Path(__file__).resolve().parent / "infra"))
import controlplane
import realnode
from controlplane import ControlPlane, ControlPlaneError
from node_pools import NodePool, create_pool, delete_pool
from realnode import RealCluster
from shared_cluster import SharedControlPlane, SharedRealCluster

K8S_DIR = Path(__file__).resolve().parent
REAL_NODE_DIR = K8S_DIR / "realnode"
# A cold build (tens of minutes on two cores) may happen inside the first test's setup when
# pytest is run directly; scripts/test.sh builds before pytest, so CI never needs this.
COLD_BUILD_TIMEOUT_S = 2 * 3600
# A real-node test may start the cluster (importing a changed engine image takes minutes) and
# then deploys real pods.
REAL_NODE_TIMEOUT_S = 1200
RUN_DIR_ENV = "M3STACK_K8S_RUN_DIR"
REAL_RUN_DIR_ENV = "M3STACK_K8S_REAL_RUN_DIR"
IMAGES_COMMAND = [str(K8S_DIR.parents[1] / "scripts" / "dev"), "images"]


def _images_current() -> bool:
    return subprocess.run([*IMAGES_COMMAND, "--print-manifest"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    k8s_items = [item for item in items if K8S_DIR in item.path.parents]
    real_items = [item for item in k8s_items if REAL_NODE_DIR in item.path.parents]
    for item in k8s_items:
        item.add_marker(pytest.mark.k8s)
    for item in real_items:
        # They share one real node (one per machine), on one xdist worker (tests/conftest.py's
        # SAME_WORKER_PATHS), one test at a time.
        item.add_marker(pytest.mark.timeout(REAL_NODE_TIMEOUT_S))
    built = True
    if k8s_items and not os.environ.get(RUN_DIR_ENV):
        try:
            controlplane.binaries_dir(build=False)
        except ControlPlaneError:
            built = False
    if real_items and not os.environ.get(REAL_RUN_DIR_ENV):
        built = built and realnode.node_binaries_dir(build=False) is not None and _images_current()
    if not built:
        for item in k8s_items:
            item.add_marker(pytest.mark.timeout(COLD_BUILD_TIMEOUT_S))


def _run_key(config: pytest.Config) -> str:
    """The same string in every xdist worker of one run (and unique to the run)."""
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        return str(worker_input["testrunuid"])
    return f"pid{os.getpid()}"


@pytest.fixture(scope="session")
def k8s_cluster(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    external = os.environ.get(RUN_DIR_ENV)
    if external:
        try:
            plane = controlplane.load(Path(external))
        except ControlPlaneError as error:
            pytest.fail(f"{RUN_DIR_ENV}={external}: {error}", pytrace=False)
        if not controlplane.running(plane):
            pytest.fail(f"{RUN_DIR_ENV}={external}: its control plane is not running", pytrace=False)
        yield plane
        return
    shared = SharedControlPlane(Path(tempfile.gettempdir()) / f"m3stack-k8s-{_run_key(request.config)}")
    try:
        plane = shared.acquire()
    except ControlPlaneError as error:
        pytest.fail(f"the Kubernetes test control plane could not start:\n{error}", pytrace=False)
    try:
        yield plane
    finally:
        shared.release()


@pytest.fixture(scope="session")
def k8s_real_cluster(request: pytest.FixtureRequest) -> Iterator[RealCluster]:
    external = os.environ.get(REAL_RUN_DIR_ENV)
    if external:
        if not realnode.running(Path(external)):
            pytest.fail(f"{REAL_RUN_DIR_ENV}={external}: no real-node cluster runs there", pytrace=False)
        yield realnode.load(Path(external))
        return
    # The images of this tree, built first when missing or stale (scripts/test.sh builds them before pytest).
    images = subprocess.run(IMAGES_COMMAND, stdout=subprocess.PIPE, text=True)
    if images.returncode != 0:
        pytest.fail(f"{' '.join(IMAGES_COMMAND)} failed (exit {images.returncode})", pytrace=False)
    manifest = Path(images.stdout.strip().splitlines()[-1])
    shared = SharedRealCluster(Path(tempfile.gettempdir()) / f"m3stack-k8s-real-{_run_key(request.config)}", manifest)
    try:
        cluster = shared.acquire()
    except ControlPlaneError as error:
        pytest.fail(f"the real-node test cluster could not start:\n{error}", pytrace=False)
    try:
        yield cluster
    finally:
        shared.release()


@pytest.fixture
def k8s_real_namespace(request: pytest.FixtureRequest, k8s_real_cluster: RealCluster) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    k8s_real_cluster.plane.kubectl("create", "namespace", name)
    yield name
    _delete_real_namespace(k8s_real_cluster.plane, name)


# A namespace whose pods are gone is usually deleted in seconds, but on a loaded CI run (the whole suite beside the
# real node on two cores) the namespace controller's retries ran past 120 s once (CI 2026-12-04, the quick start's).
NAMESPACE_DELETE_TIMEOUT_S = 300


def _delete_real_namespace(plane: ControlPlane, name: str) -> None:
    """Deletes and waits for the namespace (its pods give their CPU back before the next test deploys); if it
    outlives the wait, the error names what is still in it and the namespace's own conditions."""
    try:
        plane.kubectl("delete", "namespace", name, f"--timeout={NAMESPACE_DELETE_TIMEOUT_S}s")
    except ControlPlaneError as error:
        kinds = plane.kubectl("api-resources", "--verbs=list", "--namespaced", "-o", "name").split()
        left = plane.kubectl("get", ",".join(kinds), "-n", name, "--ignore-not-found", "-o", "name")
        conditions = plane.kubectl("get", "namespace", name, "--ignore-not-found", "-o",
                                   "jsonpath={.status.conditions}")  # fmt: skip
        raise ControlPlaneError(
            f"{error}\nstill in {name}:\n{left or '(nothing listed)'}\nconditions: {conditions}"
        ) from error


@pytest.fixture(scope="session")
def k8s_kubeconfig(k8s_cluster: ControlPlane) -> Path:
    return k8s_cluster.kubeconfig


@pytest.fixture(scope="session")
def k8s_client(k8s_cluster: ControlPlane) -> Iterator[Callable[..., client.ApiClient]]:
    """Factory: k8s_client(kubeconfig=None) -> ApiClient (admin when kubeconfig is None)."""
    opened: list[client.ApiClient] = []

    def make(kubeconfig: Path | str | None = None) -> client.ApiClient:
        api_client = config.new_client_from_config(config_file=str(kubeconfig or k8s_cluster.kubeconfig))
        opened.append(api_client)
        return api_client

    yield make
    for api_client in opened:
        api_client.close()


def _namespace_name(test_name: str) -> str:
    """A DNS-1123 label from the test's name plus a random suffix."""
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:45].rstrip("-")
    return f"t-{stem}-{secrets.token_hex(3)}"


@pytest.fixture
def k8s_namespace(request: pytest.FixtureRequest, k8s_cluster: ControlPlane) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    k8s_cluster.kubectl("create", "namespace", name)
    yield name
    # The namespace controller finishes the deletion in the background.
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def k8s_env(k8s_cluster: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = k8s_cluster.env()
    monkeypatch.setenv("KUBECONFIG", env["KUBECONFIG"])
    monkeypatch.setenv("PATH", env["PATH"])
    return env


@pytest.fixture
def k8s_node_pool(k8s_cluster: ControlPlane, k8s_namespace: str) -> Iterator[Callable[..., NodePool]]:
    """Factory: k8s_node_pool(count=1, gpus=8, product="NVIDIA-H200") -> NodePool; removed after the test."""
    pools: list[NodePool] = []

    def make(count: int = 1, gpus: int = 8, product: str = "NVIDIA-H200") -> NodePool:
        # Named after the test's namespace, which is unique in the run.
        pool = create_pool(k8s_cluster, f"{k8s_namespace}-p{len(pools)}", count, gpus, product)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        delete_pool(k8s_cluster, pool)
