"""Two operator replicas on the real API server: one Lease, one reconciler, a standby that takes over.

Both run as the chart's ServiceAccount (so the chart's Lease Role is what lets them elect), on a Lease of
this test's own in the chart's namespace.  The leader is killed with SIGKILL while a reconcile is stuck half
way (a Service someone else controls blocks it, as in test_restart.py): the standby must take the Lease
within 15 s, and finish the work without duplicate children or extra rollouts.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from controlplane import ControlPlane
from m3d_testkit import RELEASE_NAMESPACE, Kube, OperatorProcess, deployment, live_pods, m3deployment, wait_for
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

TAKEOVER_BOUND_S = 15.0


def lease_holder(cluster: ControlPlane, lease: str) -> str | None:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{lease}"
    try:
        return cluster.get_json(path)["spec"].get("holderIdentity")
    except Exception:  # not created yet
        return None


def metrics(process: OperatorProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{process.port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def reconciles(process: OperatorProcess) -> float:
    return sum(
        value for (name, labels), value in metrics(process).items() if name == "controller_runtime_reconcile_total"
    )


def is_leader(process: OperatorProcess, lease: str) -> bool:
    return metrics(process)[("leader_election_master_status", (("name", lease),))] == 1


@pytest.fixture
def replicas(k8s_cluster: ControlPlane, chart, k8s_namespace: str, tmp_path: Path):
    lease = f"ha-{k8s_namespace}"[:63]
    started: list[OperatorProcess] = []

    def start(identity: str) -> OperatorProcess:
        process = OperatorProcess(
            k8s_cluster, chart.service_account_kubeconfig, k8s_namespace, tmp_path / f"{identity}.log"
        )
        started.append(process)
        return process.start(
            extra_args=("--leader-election", "--leader-election-namespace", RELEASE_NAMESPACE,
                        "--leader-election-lease", lease, "--leader-election-identity", identity),
        )  # fmt: skip

    yield start, lease
    for process in started:
        process.stop()
    for process in started:
        logger.info("--- %s ---\n%s", process.log_path.name, process.log_tail(40))


def test_the_standby_takes_over_a_killed_leader_mid_reconcile_without_duplicates(k8s_cluster, kube: Kube, replicas):
    start, lease = replicas
    first = start("replica-a")
    wait_for("replica-a to take the Lease", lambda: lease_holder(k8s_cluster, lease) == "replica-a")
    second = start("replica-b")
    assert lease_holder(k8s_cluster, lease) == "replica-a" and not is_leader(second, lease)
    assert is_leader(first, lease)

    # A reconcile the leader cannot finish: the gateway Service belongs to someone else.
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "someone-else"}})
    owner_uid = kube.json("get", "configmap", "someone-else")["metadata"]["uid"]
    kube.apply({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "contested-gateway",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "someone-else", "uid": owner_uid,
                                 "controller": True}],
        },
        "spec": {"ports": [{"port": 80}]},
    })  # fmt: skip
    names = ["contested", "calm-1", "calm-2"]
    for name in names:
        kube.apply(m3deployment(name, {"engine": {"replicas": 2}}))
    wait_for(
        "the leader to be stuck half way",
        lambda: kube.condition("contested", "Degraded").get("reason") == "ReconcileFailed",
    )
    assert deployment(kube, "contested-engine") is None, "nothing after the blocked child was applied"
    assert reconciles(second) == 0, "the standby reconciled"
    errors = metrics(first)[("controller_runtime_reconcile_errors_total", (("controller", "m3deployment"),))]
    assert errors >= 1

    first.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    kube("delete", "service", "contested-gateway")
    wait_for("replica-b to take the Lease", lambda: lease_holder(k8s_cluster, lease) == "replica-b", timeout_s=30)
    takeover_s = time.monotonic() - killed_at
    assert takeover_s <= TAKEOVER_BOUND_S, f"took {takeover_s:.1f}s"
    logger.info("takeover after SIGKILL: %.1fs", takeover_s)

    for name in names:
        kube.wait_all_ready(name)
        children = kube.children(name)
        kinds = [(c["kind"], c["metadata"]["name"]) for c in children]
        assert len(kinds) == len(set(kinds)) == 8, kinds
        assert all(
            [ref["name"] for ref in c["metadata"]["ownerReferences"] if ref.get("controller")] == [name]
            for c in children
        )
        replica_sets = kube.json("get", "replicasets", "-l", f"m3stack.io/deployment={name}")["items"]
        owners = [rs["metadata"]["ownerReferences"][0]["name"] for rs in replica_sets]
        assert sorted(owners) == [f"{name}-engine", f"{name}-gateway"], "a rollout after the takeover"
        assert len(live_pods(kube, f"m3stack.io/deployment={name},m3stack.io/component=engine")) == 2
    assert is_leader(second, lease) and reconciles(second) > 0
    samples = metrics(second)
    assert ("workqueue_depth", (("name", "m3deployment"),)) in samples
    assert json.dumps(kube.m3d("contested")["status"]).count("ReconcileFailed") == 0


def test_a_stopping_leader_hands_the_lease_over_at_once(k8s_cluster, kube: Kube, replicas):
    start, lease = replicas
    first = start("replica-c")
    wait_for("replica-c to take the Lease", lambda: lease_holder(k8s_cluster, lease) == "replica-c")
    second = start("replica-d")
    first.stop(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert first.process.returncode == 0
    wait_for("replica-d to take the Lease", lambda: lease_holder(k8s_cluster, lease) == "replica-d", timeout_s=30)
    # Released, not expired: within about one retry period (2 s), far below the 8 s lease.
    handover_s = time.monotonic() - stopped_at
    assert handover_s < 6.0, f"took {handover_s:.1f}s"
    logger.info("handover after SIGTERM: %.1fs", handover_s)
    kube.apply(m3deployment("after-handover"))
    kube.wait_all_ready("after-handover")
    assert is_leader(second, lease)


def test_a_standby_stops_at_once_on_sigterm(k8s_cluster, replicas):
    """Before kopf runs, the operator handles SIGTERM itself: in a pod it is PID 1, which an unhandled SIGTERM
    does not stop, so a standby would otherwise sit out the pod's whole grace period (here it would die by the
    signal, exit -15, instead of stopping cleanly)."""
    start, lease = replicas
    leader = start("replica-e")
    wait_for("replica-e to take the Lease", lambda: lease_holder(k8s_cluster, lease) == "replica-e")
    standby = start("replica-f")
    assert standby.process is not None
    stopping_at = time.monotonic()
    standby.stop(signal.SIGTERM)
    stopped_s = time.monotonic() - stopping_at
    assert standby.process.returncode == 0, standby.log_tail()
    assert "stopped while standing by" in standby.log_tail()
    assert stopped_s < 5.0, f"took {stopped_s:.1f}s"
    assert lease_holder(k8s_cluster, lease) == "replica-e" and is_leader(leader, lease)
