"""An operator killed while a reconcile is half done converges after a restart, with no duplicates."""

from __future__ import annotations

import signal

from m3d_testkit import deployment, live_pods, m3deployment, wait_for


def test_a_restart_in_the_middle_of_a_reconcile_converges_without_duplicates(kube, operator):
    # A Service someone else controls blocks the reconcile half-way: the children before it in apply
    # order exist, the ones after it do not, and the failure is reported on the resource.
    foreign_owner = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "someone-else"}}
    kube.apply(foreign_owner)
    owner_uid = kube.json("get", "configmap", "someone-else")["metadata"]["uid"]
    blocker = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "restarted-gateway",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "someone-else", "uid": owner_uid, "controller": True}
            ],
        },
        "spec": {"ports": [{"port": 80}]},
    }
    kube.apply(blocker)
    operator.start()
    kube.apply(m3deployment("restarted", {"engine": {"replicas": 2}}))
    wait_for(
        "the conflict to be reported",
        lambda: kube.condition("restarted", "Degraded").get("reason") == "ReconcileFailed",
    )
    assert {c["metadata"]["name"] for c in kube.children("restarted", "configmaps,services")} == {
        "restarted-config",
        "restarted-engine",
    }
    assert deployment(kube, "restarted-engine") is None, "nothing after the blocked child was applied"
    operator.stop(signal.SIGKILL)
    kube("delete", "service", "restarted-gateway")
    operator.start()
    body = kube.wait_all_ready("restarted")
    assert kube.condition("restarted", "Degraded")["status"] == "False"
    children = kube.children("restarted")
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(names) == len(set(names)) == 8  # the core children of test_operator.py, NetworkPolicy included
    for name in ("restarted-engine", "restarted-gateway"):
        replica_sets = kube.json("get", "replicasets", "-l", "m3stack.io/deployment=restarted")["items"]
        assert len([rs for rs in replica_sets if rs["metadata"]["ownerReferences"][0]["name"] == name]) == 1
    assert len(live_pods(kube, "m3stack.io/deployment=restarted,m3stack.io/component=engine")) == 2
    assert body["status"]["engine"]["readyReplicas"] == 2
