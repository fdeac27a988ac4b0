"""Fixtures for the operator on the real control plane.

- ``chart`` (session): the Helm chart installed with ``helm install --wait`` (CRD, RBAC, operator
  Deployment on a fake node), and a kubeconfig holding a token of the chart's own ServiceAccount.
- ``operator`` (function): a factory starting the real operator (``m3stack operator``, the command
  the image runs) as a host process with that token, watching the test's namespace; stopped after.
- ``kube`` (function): kubectl against the test's namespace, returning parsed JSON.

Every test here shares one chart release (the CRD is cluster-wide), installed once per control plane.
"""

from __future__ import annotations

import fcntl
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from controlplane import ControlPlane

sys.path.insert(0, str(Path(__file__).resolve().parent))
from m3d_testkit import CHART, RELEASE, RELEASE_NAMESPACE, SERVICE_ACCOUNT, Kube, OperatorProcess


@dataclass(frozen=True)
class Chart:
    service_account_kubeconfig: Path


@pytest.fixture(scope="session")
def chart(k8s_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Chart:
    """The chart, installed once per control plane: the xdist workers of a run share the cluster, so
    the first one installs under a file lock and the others find it done.  It stays installed (the
    control plane goes away with the run; a reused one gets `helm upgrade --install` next time)."""
    helm = str(k8s_cluster.binary("helm"))
    with (k8s_cluster.run_dir / "m3stack-chart.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = k8s_cluster.run_dir / "m3stack-chart.installed"
        if not done.exists():
            install = k8s_cluster.run(
                [helm, "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                 "--create-namespace", "--wait", "--timeout", "2m"],
                check=False,
            )  # fmt: skip
            if install.returncode != 0:
                pytest.fail(f"helm upgrade --install failed:\n{install.stdout}\n{install.stderr}", pytrace=False)
            done.touch()
    kubeconfig = tmp_path_factory.mktemp("chart") / "operator-sa.kubeconfig"
    k8s_cluster.service_account_kubeconfig(RELEASE_NAMESPACE, SERVICE_ACCOUNT, kubeconfig)
    return Chart(service_account_kubeconfig=kubeconfig)


@pytest.fixture
def kube(k8s_cluster: ControlPlane, k8s_namespace: str) -> Kube:
    return Kube(k8s_cluster, k8s_namespace)


@pytest.fixture
def operator(
    k8s_cluster: ControlPlane, chart: Chart, k8s_namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(k8s_cluster, chart.service_account_kubeconfig, k8s_namespace, tmp_path / "operator.log")
    yield process
    process.stop()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        sys.stderr.write(f"\n--- operator log ---\n{process.log_tail()}\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
