"""Status aggregation: observed Deployments and pods in, conditions, counts, phase and transitions out."""

from typing import Any

import pytest

from m3stack.operator.status import Observed, compute_status, needs_pods, status_changed

T0, T1 = "2026-11-30T10:00:00Z", "2026-11-30T10:05:00Z"


def deployment(
    component: str,
    desired: int,
    ready: int = 0,
    *,
    updated: int | None = None,
    replicas: int | None = None,
    generation: int = 2,
    observed: int = 2,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"demo-{component}",
            "generation": generation,
            "labels": {"m3stack.io/component": component},
        },
        "spec": {"replicas": desired},
        "status": {
            "observedGeneration": observed,
            "replicas": desired if replicas is None else replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": desired if updated is None else updated,
        },
    }


def pod(
    component: str, name: str, *, conditions=(), waiting: str | None = None, running_unstarted=False, deleting=False
) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": waiting, "message": "back-off pulling"}} if waiting else {}
    if running_unstarted:
        state = {"running": {"startedAt": T0}}
    metadata: dict[str, Any] = {"name": name, "labels": {"m3stack.io/component": component}}
    if deleting:
        metadata["deletionTimestamp"] = T0
    return {
        "metadata": metadata,
        "status": {
            "phase": "Running" if running_unstarted else "Pending",
            "conditions": list(conditions),
            "containerStatuses": [{"name": component, "state": state, "started": False, "ready": False}]
            if state
            else [],
        },
    }


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/5 nodes are available: 5 Insufficient nvidia.com/gpu.",
}


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {condition["type"]: condition for condition in status["conditions"]}


def compute(m3d, deployments, pods=(), previous=None, *, error=None, now=T0, generation=3):
    return compute_status(
        m3d,
        Observed(
            deployments={d["metadata"]["labels"]["m3stack.io/component"]: d for d in deployments},
            pods=pods,
            reconcile_error=error,
        ),
        previous or {},
        observed_generation=generation,
        now=now,
    )


def test_everything_ready(make_m3d):
    m3d = make_m3d({"engine": {"replicas": 3}})
    status, transitions = compute(m3d, [deployment("engine", 3, 3), deployment("gateway", 2, 2)])
    found = conditions(status)
    assert found["Ready"]["status"] == "True"
    assert found["EnginesReady"]["reason"] == "AllReplicasReady"
    assert found["Progressing"]["status"] == "False"
    assert found["Degraded"]["status"] == "False"
    assert found["AutoscalingActive"]["reason"] == "Disabled"
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 3
    assert status["engine"] == {
        "replicas": 3,
        "readyReplicas": 3,
        "updatedReplicas": 3,
        "availableReplicas": 3,
        "selector": "m3stack.io/component=engine,m3stack.io/deployment=demo",
    }
    assert status["gateway"]["readyReplicas"] == 2
    assert status["url"] == "http://demo-gateway.models.svc:8000/v1"
    assert [(t.type, t.status, t.healthy) for t in transitions] == [("Ready", "True", True)]


def test_unschedulable_engines_are_insufficient_capacity_and_degrade(make_m3d):
    m3d = make_m3d()
    pods = [pod("engine", "demo-engine-a", conditions=[UNSCHEDULABLE]), pod("gateway", "demo-gateway-a")]
    status, transitions = compute(m3d, [deployment("engine", 1, 0), deployment("gateway", 2, 2)], pods)
    found = conditions(status)
    assert found["Ready"]["status"] == "False"
    assert found["Ready"]["reason"] == "InsufficientCapacity"
    assert "Insufficient nvidia.com/gpu" in found["Ready"]["message"]
    assert found["EnginesReady"]["reason"] == "InsufficientCapacity"
    assert found["GatewayReady"]["status"] == "True"
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == ("True", "InsufficientCapacity")
    assert status["phase"] == "Degraded"
    assert [(t.type, t.reason, t.healthy) for t in transitions] == [("Degraded", "InsufficientCapacity", False)]


@pytest.mark.parametrize(
    ("engine_pod", "reason", "degraded"),
    [
        (pod("engine", "e", waiting="ImagePullBackOff"), "ImagePullBackOff", True),
        (pod("engine", "e", waiting="ErrImagePull"), "ImagePullBackOff", True),
        (pod("engine", "e", waiting="CrashLoopBackOff"), "CrashLoopBackOff", True),
        (pod("engine", "e", waiting="CreateContainerConfigError"), "CreateContainerConfigError", True),
        (pod("engine", "e", running_unstarted=True), "ModelLoading", False),
        (pod("engine", "e", waiting="ContainerCreating"), "ReplicasNotReady", False),
        (pod("engine", "e", conditions=[UNSCHEDULABLE], deleting=True), "ReplicasNotReady", False),
    ],
)
def test_why_engines_are_not_ready(make_m3d, engine_pod, reason, degraded):
    status, _ = compute(make_m3d(), [deployment("engine", 1, 0), deployment("gateway", 2, 2)], [engine_pod])
    found = conditions(status)
    assert found["EnginesReady"]["reason"] == reason
    assert found["Ready"]["reason"] == reason
    assert (found["Degraded"]["status"] == "True") is degraded


def crashed(pod_: dict[str, Any], *, exit_code: int, reason: str, message: str | None, restarts: int = 3):
    """``pod_`` after its container exited ``restarts`` times (the last time as given)."""
    (container,) = pod_["status"]["containerStatuses"]
    terminated = {"exitCode": exit_code, "reason": reason, **({"message": message} if message else {})}
    container.update(lastState={"terminated": terminated}, restartCount=restarts)
    container["state"]["waiting"]["message"] = "back-off 40s restarting failed container=engine pod=e_ns(uid)"
    return pod_


ENGINE_LOG_TAIL = (
    "2026-12-04 07:59:20,001 INFO m3stack.engine.cli: starting\n"
    "2026-12-04 07:59:24,614 ERROR m3stack.engine.cli: --model '/models/nope' is not a folder\n\n"
)


@pytest.mark.parametrize(
    ("exit_code", "reason", "message", "expected"),
    [
        (
            1,
            "Error",
            ENGINE_LOG_TAIL,
            "container engine exited with code 1 (restarted 3 times): "
            "2026-12-04 07:59:24,614 ERROR m3stack.engine.cli: --model '/models/nope' is not a folder",
        ),
        (137, "OOMKilled", None, "container engine exited with code 137, OOMKilled (restarted 3 times)"),
        (1, "Error", "x" * 5000, "container engine exited with code 1 (restarted 3 times): " + "x" * 499 + "\u2026"),
    ],
)
def test_a_crash_loop_says_why_the_container_exited(make_m3d, exit_code, reason, message, expected):
    engine_pod = crashed(
        pod("engine", "e", waiting="CrashLoopBackOff"), exit_code=exit_code, reason=reason, message=message
    )
    status, transitions = compute(make_m3d(), [deployment("engine", 1, 0), deployment("gateway", 2, 2)], [engine_pod])
    found = conditions(status)
    assert found["EnginesReady"]["message"] == f"0/1 ready, 1 updated: pod e: {expected}"
    assert found["Degraded"]["reason"] == "CrashLoopBackOff"
    assert "back-off" not in found["Degraded"]["message"], "the kubelet's back-off says nothing about why"
    assert [t.message for t in transitions] == [found["Degraded"]["message"]]


def test_gateways_waiting_for_an_engine_say_so(make_m3d):
    # A gateway is ready only once an engine is (its /ready): without this, 0/2 ready and no reason.
    status, _ = compute(
        make_m3d({"engine": {"replicas": 0}}), [deployment("engine", 0, 0), deployment("gateway", 2, 0)]
    )
    found = conditions(status)
    assert (found["GatewayReady"]["reason"], found["GatewayReady"]["message"]) == (
        "WaitingForEngines",
        "0/2 ready, 2 updated: a gateway is ready once an engine is, and no engine is ready",
    )
    status, _ = compute(make_m3d(), [deployment("engine", 1, 1), deployment("gateway", 2, 0)])
    assert conditions(status)["GatewayReady"]["reason"] == "ReplicasNotReady", "an engine is ready: another cause"


def test_the_worst_problem_among_pods_wins(make_m3d):
    pods = [
        pod("engine", "loading", running_unstarted=True),
        pod("engine", "pulling", waiting="ImagePullBackOff"),
        pod("engine", "pending", conditions=[UNSCHEDULABLE]),
    ]
    status, _ = compute(
        make_m3d({"engine": {"replicas": 3}}), [deployment("engine", 3, 0), deployment("gateway", 2, 2)], pods
    )
    assert conditions(status)["EnginesReady"]["reason"] == "InsufficientCapacity"


def test_gateway_problems_only_show_when_engines_are_fine(make_m3d):
    pods = [pod("gateway", "g", waiting="ImagePullBackOff"), pod("engine", "e", running_unstarted=True)]
    status, _ = compute(make_m3d(), [deployment("engine", 1, 1), deployment("gateway", 2, 0)], pods)
    found = conditions(status)
    assert found["Ready"]["reason"] == "ImagePullBackOff"
    assert found["Ready"]["message"].startswith("gateways:")
    assert found["EnginesReady"]["status"] == "True", "a ready engine's pod list is not searched for problems"


def test_a_scale_up_keeps_serving_while_the_new_engine_loads(make_m3d):
    """1 -> 2 engines (kubectl scale, the autoscaler): Ready stays True, no event; EnginesReady says who lags."""
    m3d = make_m3d({"engine": {"replicas": 2}})
    before, _ = compute(m3d, [deployment("engine", 1, 1), deployment("gateway", 2, 2)], now=T0)
    loading = [pod("engine", "demo-engine-b", running_unstarted=True)]
    status, transitions = compute(
        m3d, [deployment("engine", 2, 1), deployment("gateway", 2, 2)], loading, previous=before, now=T1
    )
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("True", "PartiallyReady")
    assert found["Ready"]["message"] == (
        "serving, not every replica ready: engines 1/2 ready, 2 updated: pod demo-engine-b is loading the model; "
        "gateways 2/2 ready, 2 updated"
    )
    assert found["Ready"]["lastTransitionTime"] == T0, "still serving: no transition"
    assert (found["EnginesReady"]["status"], found["EnginesReady"]["reason"]) == ("False", "ModelLoading")
    assert found["Degraded"]["status"] == "False"
    assert status["phase"] == "Ready"
    assert transitions == [], "a scale-up is no news: no Ready event"
    done, transitions = compute(m3d, [deployment("engine", 2, 2), deployment("gateway", 2, 2)], previous=status)
    assert conditions(done)["Ready"]["reason"] == "AllComponentsReady"
    assert transitions == []


def test_no_ready_engine_is_not_ready_however_many_gateways(make_m3d):
    loading = [pod("engine", "a", running_unstarted=True), pod("engine", "b", running_unstarted=True)]
    status, _ = compute(
        make_m3d({"engine": {"replicas": 2}}), [deployment("engine", 2, 0), deployment("gateway", 2, 2)], loading
    )
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("False", "ModelLoading")
    assert found["Ready"]["message"].startswith("engines: 0/2 ready")
    assert status["phase"] == "Progressing"


def test_a_crash_looping_extra_replica_degrades_a_resource_that_serves(make_m3d):
    crashing = crashed(pod("engine", "b", waiting="CrashLoopBackOff"), exit_code=1, reason="Error", message="boom")
    status, transitions = compute(
        make_m3d({"engine": {"replicas": 2}}), [deployment("engine", 2, 1), deployment("gateway", 2, 2)], [crashing]
    )
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("True", "PartiallyReady")
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == ("True", "CrashLoopBackOff")
    assert found["EnginesReady"]["status"] == "False"
    assert status["phase"] == "Degraded", "Degraded takes precedence over Ready"
    assert [(t.type, t.status) for t in transitions] == [("Ready", "True"), ("Degraded", "True")]


def test_a_gateway_short_of_its_count_leaves_the_resource_serving(make_m3d):
    status, _ = compute(make_m3d(), [deployment("engine", 1, 1), deployment("gateway", 2, 1)])
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("True", "PartiallyReady")
    assert (found["GatewayReady"]["status"], found["EnginesReady"]["status"]) == ("False", "True")


def test_a_rollout_in_progress_is_progressing(make_m3d):
    status, _ = compute(
        make_m3d({"engine": {"replicas": 2}}),
        [deployment("engine", 2, 2, updated=1, replicas=3, generation=5, observed=5), deployment("gateway", 2, 2)],
    )
    found = conditions(status)
    assert (found["Progressing"]["status"], found["Progressing"]["reason"]) == ("True", "Updating")
    assert found["Ready"]["status"] == "True", "old pods still serve while new ones come up"
    assert status["phase"] == "Ready"


def test_a_deployment_that_has_not_seen_its_new_spec_is_not_rolled_out(make_m3d):
    status, _ = compute(make_m3d(), [deployment("engine", 1, 0, generation=6, observed=5), deployment("gateway", 2, 2)])
    found = conditions(status)
    assert found["Progressing"]["status"] == "True"
    assert found["EnginesReady"]["reason"] == "Updating"
    assert status["phase"] == "Progressing"


def test_children_not_created_yet(make_m3d):
    status, transitions = compute(make_m3d(), [])
    found = conditions(status)
    assert found["Ready"]["reason"] == "NotCreated"
    assert status["phase"] == "Pending"
    assert status["engine"]["replicas"] == 0
    assert transitions == []


def test_suspended(make_m3d):
    status, _ = compute(make_m3d({"suspend": True}), [deployment("engine", 0), deployment("gateway", 0)])
    found = conditions(status)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("False", "Suspended")
    assert status["phase"] == "Suspended"


def test_engines_scaled_to_zero_are_not_ready(make_m3d):
    status, _ = compute(make_m3d({"engine": {"replicas": 0}}), [deployment("engine", 0), deployment("gateway", 2, 2)])
    assert conditions(status)["EnginesReady"]["reason"] == "ScaledToZero"


def test_a_failed_apply_degrades(make_m3d):
    status, transitions = compute(
        make_m3d(),
        [deployment("engine", 1, 1), deployment("gateway", 2, 2)],
        error="403 Forbidden: no create on ingresses",
    )
    found = conditions(status)
    assert (found["Degraded"]["reason"], found["Degraded"]["message"]) == (
        "ReconcileFailed",
        "403 Forbidden: no create on ingresses",
    )
    assert status["phase"] == "Degraded"
    assert ("Degraded", False) in [(t.type, t.healthy) for t in transitions]


def test_transition_times_move_only_when_a_status_flips(make_m3d):
    m3d = make_m3d()
    first, _ = compute(m3d, [deployment("engine", 1, 0), deployment("gateway", 2, 2)], now=T0)
    same, transitions = compute(m3d, [deployment("engine", 1, 0), deployment("gateway", 2, 2)], previous=first, now=T1)
    assert same == first
    assert transitions == []
    assert not status_changed(same, first)
    ready, transitions = compute(m3d, [deployment("engine", 1, 1), deployment("gateway", 2, 2)], previous=first, now=T1)
    assert status_changed(ready, first)
    found, before = conditions(ready), conditions(first)
    assert found["Ready"]["lastTransitionTime"] == T1
    assert found["GatewayReady"]["lastTransitionTime"] == before["GatewayReady"]["lastTransitionTime"] == T0
    assert [(t.type, t.status) for t in transitions] == [("Ready", "True")]
    _, transitions = compute(m3d, [deployment("engine", 1, 0), deployment("gateway", 2, 2)], previous=ready, now=T1)
    assert [(t.type, t.status, t.healthy) for t in transitions] == [("Ready", "False", False)]


def test_other_writers_conditions_are_neither_written_nor_compared(make_m3d):
    """The autoscaler applies AutoscalingActive itself (its own field manager) while a mode is set."""
    ready = [deployment("engine", 1, 1), deployment("gateway", 2, 2)]
    reported = {"type": "AutoscalingActive", "status": "True", "reason": "Scaling", "message": "3 engines"}
    builtin = make_m3d({"autoscaling": {"engine": {"mode": "Builtin"}}})
    status, _ = compute(builtin, ready)
    assert "AutoscalingActive" not in conditions(status)
    with_autoscaler = {**status, "conditions": [*status["conditions"], reported]}
    assert not status_changed(status, with_autoscaler)
    disabled, _ = compute(make_m3d(), ready, previous=with_autoscaler)
    assert conditions(disabled)["AutoscalingActive"]["reason"] == "Disabled"
    assert status_changed(disabled, with_autoscaler)
    # Switching a mode on drops the Disabled condition this module wrote.
    assert status_changed(status, disabled)


def test_pods_are_read_only_when_something_is_not_ready(make_m3d):
    m3d = make_m3d()
    ready = {"engine": deployment("engine", 1, 1), "gateway": deployment("gateway", 2, 2)}
    assert not needs_pods(m3d, ready)
    assert needs_pods(m3d, {**ready, "gateway": deployment("gateway", 2, 1)})
    # No pods can explain a Deployment that does not exist or that its controller has not seen yet.
    assert not needs_pods(m3d, {"engine": deployment("engine", 1, 1)})
    assert not needs_pods(m3d, {**ready, "gateway": deployment("gateway", 2, 0, generation=3, observed=2)})
