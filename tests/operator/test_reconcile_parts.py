"""The cluster-free parts of reconciliation: coalescing of status refreshes, ownership, owner lookup.
The reconcile itself runs against the real control plane in tests/k8s/operator."""

import threading

import pytest

from m3stack.operator.handlers import owner_key, plain
from m3stack.operator.reconcile import KeyedCoalescer, controlled_by


def test_calls_during_a_run_fold_into_one_more_run():
    coalescer = KeyedCoalescer()
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def slow() -> None:
        runs.append("run")
        started.set()
        release.wait(5)

    first = threading.Thread(target=coalescer.run, args=("a", slow))
    first.start()
    assert started.wait(5)
    # Five more requests while the first run is in progress: they return at once...
    for _ in range(5):
        coalescer.run("a", lambda: runs.append("must not run inline"))
    assert runs == ["run"]
    release.set()
    first.join(5)
    # ...and amount to exactly one more run of the first caller's function.
    assert runs == ["run", "run"]


def test_keys_do_not_wait_for_each_other():
    coalescer = KeyedCoalescer()
    release = threading.Event()
    ran: list[str] = []
    blocked = threading.Thread(target=coalescer.run, args=("a", lambda: release.wait(5)))
    blocked.start()
    coalescer.run("b", lambda: ran.append("b"))
    assert ran == ["b"]
    release.set()
    blocked.join(5)


def test_a_failing_run_does_not_wedge_its_key():
    coalescer = KeyedCoalescer()

    def boom() -> None:
        raise RuntimeError("api down")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="api down"):
            coalescer.run("a", boom)
    ran: list[int] = []
    coalescer.run("a", lambda: ran.append(1))
    assert ran == [1]


def test_controlled_by_needs_the_controller_flag_and_the_uid():
    owned = {"metadata": {"ownerReferences": [{"uid": "u1", "controller": True}]}}
    assert controlled_by(owned, "u1")
    assert not controlled_by(owned, "u2")
    assert not controlled_by({"metadata": {"ownerReferences": [{"uid": "u1"}]}}, "u1")
    assert not controlled_by({"metadata": {}}, "u1")


def test_owner_key_comes_from_the_deployment_label():
    child = {"metadata": {"namespace": "ns", "name": "x-engine", "labels": {"m3stack.io/deployment": "x"}}}
    assert owner_key(child) == ("ns", "x")
    assert owner_key({"metadata": {"namespace": "ns", "labels": {}}}) is None


def test_plain_turns_views_into_dicts_and_lists():
    class View(dict):
        pass

    converted = plain(View(a=View(b=(1, 2)), c=[View(d=3)]))
    assert converted == {"a": {"b": [1, 2]}, "c": [{"d": 3}]}
    assert type(converted) is dict and type(converted["a"]) is dict
