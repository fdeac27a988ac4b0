"""The cluster-free parts of reconciliation: which events ask for what, ownership, owner lookup.
The reconcile itself runs against the real control plane in tests/k8s/operator."""

import pytest

from m3stack.operator.apply import POD
from m3stack.operator.handlers import child_work, owner_key
from m3stack.operator.objects import plain
from m3stack.operator.reconcile import controlled_by
from m3stack.operator.render import CONFIG_MAP, DEPLOYMENT, SERVICE
from m3stack.operator.workqueue import Work


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


def _pod(component: str, **status) -> dict:
    return {"metadata": {"labels": {"m3stack.io/component": component}}, "status": status}


@pytest.mark.parametrize(
    ("kind", "event_type", "body", "work"),
    [
        (SERVICE, "DELETED", {}, Work.RECONCILE),
        (CONFIG_MAP, "DELETED", {}, Work.RECONCILE),
        (DEPLOYMENT, "DELETED", {}, Work.RECONCILE),
        (DEPLOYMENT, "MODIFIED", {}, Work.REFRESH_STATUS),
        (SERVICE, "MODIFIED", {}, None),
        (POD, "MODIFIED", _pod("engine", phase="Running", conditions=[{"type": "Ready", "status": "True"}]), None),
        (POD, "DELETED", _pod("engine", phase="Running"), None),
        (
            POD,
            "MODIFIED",
            _pod("engine", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]),
            Work.REFRESH_STATUS,
        ),
        (
            POD,
            "MODIFIED",
            _pod("engine", phase="Running", containerStatuses=[{"state": {"running": {}}, "started": False}]),
            Work.REFRESH_STATUS,
        ),
        (
            POD,
            "MODIFIED",
            _pod("gateway", phase="Running", containerStatuses=[{"state": {"running": {}}, "started": False}]),
            None,
        ),
    ],
)
def test_what_an_event_asks_of_the_owner(kind, event_type, body, work):
    assert child_work(kind, event_type, body) == work
