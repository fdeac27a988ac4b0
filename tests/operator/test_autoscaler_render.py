"""KEDA and HPA modes: the ScaledObject and HorizontalPodAutoscaler rendered for the engines.  Their
acceptance by an API server (the real HPA kind, a ScaledObject CRD with KEDA's schema) is checked in
tests/k8s/autoscaler."""

import math

import pytest

from m3stack.operator.render import render_children
from m3stack.operator.render.autoscaling import behavior, default_query, quantity

PROMETHEUS = {"serverAddress": "http://prometheus.monitoring:9090"}


def _engine_autoscalers(children: list[dict]) -> list[dict]:
    return [c for c in children if c["kind"] in ("ScaledObject", "HorizontalPodAutoscaler") and "engine" in str(c)]


def _only(children: list[dict], kind: str) -> dict:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == "demo-engine"]
    return found


def test_keda_mode_renders_a_scaled_object_on_the_resources_scale(make_m3d, images):
    spec = {
        "autoscaling": {
            "engine": {
                "mode": "KEDA",
                "minReplicas": 2,
                "maxReplicas": 9,
                "targetConcurrency": 64,
                "targetUtilization": 0.7,
                "scaleDownDelaySeconds": 240,
                "prometheus": PROMETHEUS,
            }
        }
    }
    scaled = _only(render_children(make_m3d(spec), images), "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["metadata"]["labels"]["m3stack.io/deployment"] == "demo"
    body = scaled["spec"]
    assert body["scaleTargetRef"] == {"apiVersion": "m3stack.io/v1alpha1", "kind": "M3Deployment", "name": "demo"}
    assert (body["minReplicaCount"], body["maxReplicaCount"], body["cooldownPeriod"]) == (2, 9, 240)
    (trigger,) = body["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert trigger["metadata"]["serverAddress"] == PROMETHEUS["serverAddress"]
    assert float(trigger["metadata"]["threshold"]) == pytest.approx(64 * 0.7)
    assert trigger["metadata"]["query"] == (
        '(sum(m3stack_gateway_engine_inflight_requests{namespace="models",service="demo-gateway"}) or vector(0))'
    )
    assert body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == (
        240
    )


def test_keda_scaled_to_zero_also_counts_refused_requests(make_m3d):
    m3d = make_m3d({"autoscaling": {"engine": {"mode": "KEDA", "minReplicas": 0, "prometheus": PROMETHEUS}}})
    query = default_query(m3d)
    assert query.startswith("(sum(m3stack_gateway_engine_inflight_requests{")
    assert (
        ' + (sum(rate(m3stack_gateway_requests_total{namespace="models",service="demo-gateway",status="503"}[1m]))'
        " or vector(0))"
    ) in query


def test_a_query_of_ones_own_replaces_the_default(make_m3d, images):
    prometheus = {**PROMETHEUS, "query": "sum(my_inflight)"}
    m3d = make_m3d({"autoscaling": {"engine": {"mode": "KEDA", "prometheus": prometheus}}})
    (trigger,) = _only(render_children(m3d, images), "ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["query"] == "sum(my_inflight)"


def test_hpa_mode_renders_an_object_metric_on_the_gateway_service(make_m3d, images):
    spec = {
        "autoscaling": {
            "engine": {"mode": "HPA", "minReplicas": 1, "maxReplicas": 5, "targetConcurrency": 10},
            "gateway": {"enabled": True},
        }
    }
    children = render_children(make_m3d(spec), images)
    hpa = _only(children, "HorizontalPodAutoscaler")
    names = [c["metadata"]["name"] for c in children if c["kind"] == "HorizontalPodAutoscaler"]
    assert names == ["demo-gateway", "demo-engine"], "the gateway's CPU HPA and the engines' HPA live side by side"
    body = hpa["spec"]
    assert body["scaleTargetRef"] == {"apiVersion": "m3stack.io/v1alpha1", "kind": "M3Deployment", "name": "demo"}
    assert (body["minReplicas"], body["maxReplicas"]) == (1, 5)
    (metric,) = body["metrics"]
    assert metric["type"] == "Object"
    assert metric["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "demo-gateway"}
    assert metric["object"]["metric"] == {"name": "m3stack_gateway_engine_inflight_requests"}
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "7"}  # 10 x the default 0.7


@pytest.mark.parametrize("mode", ["Builtin", "None"])
def test_other_modes_render_no_engine_autoscaler(make_m3d, images, mode):
    children = render_children(make_m3d({"autoscaling": {"engine": {"mode": mode}}}), images)
    assert not [c for c in children if c["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]


@pytest.mark.parametrize("mode", ["KEDA", "HPA"])
def test_a_suspended_resource_has_no_engine_autoscaler(make_m3d, images, mode):
    spec = {"suspend": True, "autoscaling": {"engine": {"mode": mode, "prometheus": PROMETHEUS}}}
    assert not _engine_autoscalers(render_children(make_m3d(spec), images))


@pytest.mark.parametrize(("up", "down"), [(2.0, 2.0), (3.0, 1.5), (1.1, 4.0)])
def test_scale_rates_become_percent_policies(make_m3d, up, down):
    scaling = make_m3d(
        {"autoscaling": {"engine": {"mode": "HPA", "maxScaleUpRate": up, "maxScaleDownRate": down}}}
    ).spec.engine_autoscaling
    rules = behavior(scaling)
    (grow,) = rules["scaleUp"]["policies"]
    (shrink,) = rules["scaleDown"]["policies"]
    # An HPA grows to ceil(n * (1 + p/100)) and shrinks to n * (1 - p/100) per period.
    for replicas in (1, 2, 3, 7, 10, 64):
        assert math.ceil(replicas * (1 + grow["value"] / 100)) <= math.ceil(up * replicas)
        assert replicas * (1 - shrink["value"] / 100) >= replicas / down - 1e-9
    assert grow["value"] == round((up - 1) * 100)
    assert rules["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert rules["scaleDown"]["stabilizationWindowSeconds"] == scaling.scale_down_delay_seconds


@pytest.mark.parametrize(("value", "text"), [(7.0, "7"), (44.8, "44800m"), (0.35, "350m"), (12.0000001, "12")])
def test_quantities(value, text):
    assert quantity(value) == text
