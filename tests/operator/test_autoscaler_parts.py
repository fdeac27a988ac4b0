"""The built-in autoscaler's cluster-free parts: the watch-fed cluster view, the status and Event texts,
settings from the spec, the refused-request counter.  The daemon itself runs on the real control plane
in tests/k8s/autoscaler."""

from collections import deque

import pytest

from m3stack.cli import build_parser
from m3stack.operator.autoscaler import report
from m3stack.operator.autoscaler.algorithm import (
    AutoscalerConfig,
    ClusterState,
    Decision,
    Mode,
    Reason,
)
from m3stack.operator.autoscaler.cluster_view import ClusterView, engine_cluster_state, summarize_pod
from m3stack.operator.autoscaler.daemon import autoscaler_config, owns_status_fields, refused_since
from m3stack.operator.autoscaler.metrics_source import GatewayReading, Scrape

M3D = {"metadata": {"name": "demo", "namespace": "models"}, "spec": {"model": {"name": "m3-tiny"}}}


def pod(name: str, component: str, *, owner: str = "demo", phase: str = "Running", ready: bool = True, **extra):
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if extra.get("unschedulable"):
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    metadata = {
        "name": name,
        "namespace": "models",
        "labels": {"m3stack.io/deployment": owner, "m3stack.io/component": component},
    }
    if extra.get("terminating"):
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"phase": phase, "conditions": conditions, "podIP": extra.get("ip")}}


def test_engine_state_counts_ready_pending_and_unschedulable_pods_but_not_terminating_ones():
    pods = [
        summarize_pod(pod("e1", "engine")),
        summarize_pod(pod("e2", "engine", ready=False)),  # loading the model
        summarize_pod(pod("e3", "engine", phase="Pending", ready=False)),
        summarize_pod(pod("e4", "engine", phase="Pending", ready=False, unschedulable=True)),
        summarize_pod(pod("e5", "engine", terminating=True)),
    ]
    assert engine_cluster_state(4, pods) == ClusterState(4, ready_replicas=1, pending_pods=2, unschedulable_pods=1)


def test_the_view_follows_events_per_owner_and_forgets_deleted_things():
    view = ClusterView()
    key = view.on_m3deployment(None, M3D)
    assert key == ("models", "demo")
    view.on_pod(None, pod("g1", "gateway", ip="10.244.0.4"))
    view.on_pod("ADDED", pod("e1", "engine"))
    view.on_pod("ADDED", pod("other", "engine", owner="other"))
    view.on_pod("MODIFIED", pod("e1", "engine", ready=False))
    assert [(p.name, p.ready) for p in view.pods(key, "engine")] == [("e1", False)]
    assert [p.pod_ip for p in view.pods(key, "gateway")] == ["10.244.0.4"]
    view.on_pod("DELETED", pod("e1", "engine"))
    assert view.pods(key, "engine") == []
    assert view.on_pod(None, {"metadata": {"name": "x", "namespace": "models", "labels": {}}}) is None
    view.on_m3deployment("DELETED", M3D)
    assert view.m3deployment(key) is None and view.pods(key, "gateway") == []
    view.on_pod("DELETED", pod("g1", "gateway"))  # garbage collection after the owner: nothing comes back
    assert view.pods(key, "gateway") == []


def test_settings_come_from_the_spec(make_m3d):
    spec = {
        "autoscaling": {
            "engine": {
                "mode": "Builtin",
                "minReplicas": 0,
                "maxReplicas": 12,
                "targetConcurrency": 16,
                "targetUtilization": 0.5,
                "stableWindowSeconds": 90,
                "panicWindowSeconds": 9,
                "panicThreshold": 3,
                "maxScaleUpRate": 4,
                "maxScaleDownRate": 1.5,
                "scaleDownDelaySeconds": 45,
            }
        }
    }
    config = autoscaler_config(make_m3d(spec).spec.engine_autoscaling)
    assert config == AutoscalerConfig(
        target_per_engine=16,
        utilization=0.5,
        min_replicas=0,
        max_replicas=12,
        stable_window_s=90,
        panic_window_s=9,
        panic_threshold=3,
        max_scale_up_rate=4,
        max_scale_down_rate=1.5,
        scale_down_delay_s=45,
    )
    assert config.target == 8


def test_the_defaults_are_the_gpu_defaults(make_m3d):
    config = autoscaler_config(make_m3d({"autoscaling": {"engine": {"mode": "Builtin"}}}).spec.engine_autoscaling)
    assert (config.stable_window_s, config.panic_window_s, config.scale_down_delay_s) == (180, 60, 300)
    assert (config.max_scale_up_rate, config.max_scale_down_rate, config.panic_threshold) == (2, 2, 2)
    assert config.min_replicas == 1, "scale-to-zero is off by default"


def _scrape(**refused: float) -> Scrape:
    return Scrape(readings={url: GatewayReading(inflight=0, refused=value) for url, value in refused.items()})


def test_refused_requests_count_from_the_second_sighting_and_survive_a_gateway_restart():
    seen: dict[str, float] = {}
    assert refused_since(seen, _scrape(a=40, b=3)) == 0, "a first reading is a baseline, not demand"
    assert refused_since(seen, _scrape(a=43, b=3)) == 3
    assert refused_since(seen, _scrape(a=2, b=5)) == 2 + 2, "a counter that went down restarted from zero"
    assert refused_since(seen, _scrape(b=5)) == 0


def test_status_fields_are_recognized_by_their_manager():
    managed = {
        "metadata": {
            "managedFields": [
                {"manager": "m3stack-operator", "subresource": "status"},
                {"manager": "m3stack-autoscaler", "operation": "Apply", "subresource": "status"},
            ]
        }
    }
    assert owns_status_fields(managed)
    assert not owns_status_fields({"metadata": {"managedFields": [{"manager": "m3stack-autoscaler"}]}})
    assert not owns_status_fields({"metadata": {}})


CONFIG = AutoscalerConfig(target_per_engine=4, utilization=0.5, max_replicas=6)
COVERAGE = report.GatewayCoverage(targets=2, answered=2, failures={})


def test_a_decision_becomes_status_and_condition():
    decision = Decision(4, Mode.PANIC, Reason.SCALED, stable_concurrency=5.126, panic_concurrency=7.9)
    change = report.ScaleChange("2026-01-01T00:00:02Z", 2, 4, "Scaled", Mode.PANIC, 5.126)
    status = report.builtin_status(decision, ClusterState(2, 2), CONFIG, COVERAGE, [change])
    assert status["autoscaling"] == {
        "mode": "Builtin",
        "state": "Panic",
        "reason": "Scaled",
        "desiredReplicas": 4,
        "observedConcurrency": 5.13,
        "panicConcurrency": 7.9,
        "gatewayTargets": 2,
        "gatewaysScraped": 2,
        "recentDecisions": [
            {
                "time": "2026-01-01T00:00:02Z",
                "fromReplicas": 2,
                "toReplicas": 4,
                "reason": "Scaled",
                "state": "Panic",
                "observedConcurrency": 5.13,
            }
        ],
        "lastScaleTime": "2026-01-01T00:00:02Z",
    }
    (condition,) = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == ("AutoscalingActive", "True", "Scaled")
    assert "4 engines for 5.1 requests in flight (7.9 over the panic window)" in condition["message"]
    assert "target of 2 per engine, panic mode" in condition["message"]


@pytest.mark.parametrize(
    ("reason", "cluster", "active", "says"),
    [
        (Reason.INSUFFICIENT_CAPACITY, ClusterState(4, 3, 1, 1), True, "1 engine pods cannot be scheduled"),
        (Reason.PODS_PENDING, ClusterState(4, 2, 2, 0), True, "2 engine pods are still pending"),
        (Reason.MAX_REACHED, ClusterState(6, 6), True, "capped at maxReplicas 6"),
        (Reason.SCALE_DOWN_DELAYED, ClusterState(6, 6), True, "scale-down delayed"),
        (Reason.NO_DATA, ClusterState(3, 3), False, "holding 3 engines"),
    ],
)
def test_the_condition_says_why(reason, cluster, active, says):
    decision = Decision(cluster.current_replicas, Mode.STABLE, reason, 1.0, 1.0)
    coverage = report.GatewayCoverage(2, 0, {"http://127.0.0.1:9/metrics": "ConnectError"})
    (condition,) = report.builtin_status(decision, cluster, CONFIG, coverage, [])["conditions"]
    assert (condition["status"] == "True") is active
    assert condition["reason"] == reason.value
    assert says in condition["message"]
    if reason is Reason.NO_DATA:
        assert "0 of 2 gateways answered (http://127.0.0.1:9/metrics: ConnectError)" in condition["message"]


def test_only_the_last_five_changes_are_kept_in_status():
    changes = deque(report.ScaleChange(f"t{i}", i, i + 1, "Scaled", Mode.STABLE, 1.0) for i in range(8))
    decision = Decision(8, Mode.STABLE, Reason.SCALED, 1.0, 1.0)
    status = report.builtin_status(decision, ClusterState(8, 8), CONFIG, COVERAGE, changes)
    assert [d["time"] for d in status["autoscaling"]["recentDecisions"]] == ["t3", "t4", "t5", "t6", "t7"]


def test_the_transition_time_holds_while_the_status_does():
    previous = [{"type": "AutoscalingActive", "status": "True", "lastTransitionTime": "T0"}, {"type": "Ready"}]
    same = report.stamp(report.condition(True, "Scaled", "m"), previous, "T1", 4)
    assert (same["lastTransitionTime"], same["observedGeneration"]) == ("T0", 4)
    flipped = report.stamp(report.condition(False, "NoMetrics", "m"), previous, "T1", 4)
    assert flipped["lastTransitionTime"] == "T1"
    assert report.stamp(report.condition(True, "Scaled", "m"), [], "T2", 1)["lastTransitionTime"] == "T2"


def test_external_modes_name_the_object_that_drives_scale(make_m3d):
    keda = make_m3d({"autoscaling": {"engine": {"mode": "KEDA", "prometheus": {"serverAddress": "http://p:9090"}}}})
    status = report.external_status(keda)
    assert status["autoscaling"] == {"mode": "KEDA"}
    (condition,) = status["conditions"]
    assert condition["status"] == "True" and "KEDA ScaledObject demo-engine" in condition["message"]
    hpa = report.external_status(make_m3d({"autoscaling": {"engine": {"mode": "HPA", "maxReplicas": 3}}}))
    assert "HorizontalPodAutoscaler demo-engine" in hpa["conditions"][0]["message"]
    assert "(1 to 3 engines)" in hpa["conditions"][0]["message"]


def test_scale_events_say_which_way():
    up = report.ScaleChange("t", 2, 4, "Scaled", Mode.PANIC, 9.0)
    assert report.scale_event(up, "why") == ("ScaledUp", "engines 2 -> 4: why")
    down = report.ScaleChange("t", 4, 2, "Scaled", Mode.STABLE, 1.0)
    assert report.scale_event(down, "why")[0] == "ScaledDown"


def test_the_operator_command_takes_explicit_gateway_urls():
    args = build_parser().parse_args(
        ["operator", "--autoscaler-metrics-urls", "ns/demo=http://127.0.0.1:8001/metrics", "--autoscaler-interval", "1"]
    )
    assert args.autoscaler_metrics_urls == {("ns", "demo"): ("http://127.0.0.1:8001/metrics",)}
    assert args.autoscaler_interval == 1.0


def test_bad_gateway_urls_stop_the_operator_command_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["operator", "--autoscaler-metrics-urls", "demo=ftp://127.0.0.1/"])
    assert exit_info.value.code == 2
    assert "expected an http(s) URL" in capsys.readouterr().err
