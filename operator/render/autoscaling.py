"""Engine autoscaling by an external autoscaler on the built-in one's metric.

Both objects target the M3Deployment's ``/scale`` subresource (``spec.engine.replicas``; the pods are
found through ``status.engine.selector``), and both ask for the same thing as the built-in autoscaler:
``ceil(in-flight engine requests / (targetConcurrency * targetUtilization))`` engines.

- Mode ``KEDA``: a ScaledObject with a Prometheus trigger, ``metricType: AverageValue`` (KEDA's HPA
  then divides the query's value by the threshold).  The default query sums
  ``m3stack_gateway_engine_inflight_requests`` over the gateway Service's series (``namespace`` and
  ``service`` labels, as a ServiceMonitor on that Service produces); with ``minReplicas: 0`` it adds
  the rate of 503 responses, the only demand visible while no engine runs, so KEDA wakes it up.
- Mode ``HPA``: an autoscaling/v2 HorizontalPodAutoscaler with an ``Object`` metric on the gateway
  Service, target ``AverageValue`` (the HPA divides by the engine count), served by a custom-metrics
  adapter (prometheus-adapter) exposing the same series.

The scale rates and the scale-down delay become HPA ``behavior`` policies: growth by at most
``(maxScaleUpRate - 1) * 100`` percent and shrinkage by ``(1 - 1/maxScaleDownRate) * 100`` percent per
period, and scale-down stabilization over ``scaleDownDelaySeconds``.
"""

import math
from typing import Any

from m3stack.metrics import GATEWAY_INFLIGHT as INFLIGHT
from m3stack.metrics import GATEWAY_REQUESTS as REQUESTS
from m3stack.metrics import REFUSED_STATUS
from m3stack.operator.crd import API_VERSION, KIND
from m3stack.operator.render.names import ENGINE, GATEWAY, child_metadata, child_name
from m3stack.operator.spec import EngineAutoscaling, M3Deployment

# The HPA controller's default sync period: one policy period per evaluation.
POLICY_PERIOD_SECONDS = 15
# How often KEDA runs the query (its default is 30 s; half of that follows load sooner).
KEDA_POLLING_INTERVAL_SECONDS = 15
# Window of the 503 rate that wakes a deployment scaled to zero.
REFUSED_RATE_WINDOW = "1m"


def target_inflight_per_engine(scaling: EngineAutoscaling) -> float:
    return scaling.target_concurrency * scaling.target_utilization


def quantity(value: float) -> str:
    """A resource.Quantity for a positive number: whole numbers as such, others in thousandths."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _whole_percent(fraction: float) -> int:
    """A policy's percent, never above the rate it stands for (the HPA wants integers >= 1)."""
    return max(1, math.floor(fraction * 100 + 1e-9))


def behavior(scaling: EngineAutoscaling) -> dict[str, Any]:
    grow_percent = _whole_percent(scaling.max_scale_up_rate - 1)
    shrink_percent = _whole_percent(1 - 1 / scaling.max_scale_down_rate)
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": grow_percent, "periodSeconds": POLICY_PERIOD_SECONDS}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_delay_seconds,
            "selectPolicy": "Max",
            "policies": [{"type": "Percent", "value": shrink_percent, "periodSeconds": POLICY_PERIOD_SECONDS}],
        },
    }


def _scale_target(m3d: M3Deployment) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": m3d.name}


def default_query(m3d: M3Deployment) -> str:
    """PromQL for the total in-flight engine requests of the resource's gateways (plus, when it may
    scale to zero, the rate of requests refused for want of an engine)."""
    series = f'namespace="{m3d.namespace}",service="{child_name(m3d, GATEWAY)}"'
    query = f"(sum({INFLIGHT}{{{series}}}) or vector(0))"
    if m3d.spec.engine_autoscaling.min_replicas == 0:
        refused = f'{REQUESTS}{{{series},status="{REFUSED_STATUS}"}}'
        query += f" + (sum(rate({refused}[{REFUSED_RATE_WINDOW}])) or vector(0))"
    return query


def engine_scaled_object(m3d: M3Deployment) -> dict[str, Any]:
    scaling = m3d.spec.engine_autoscaling
    if scaling.prometheus is None:  # the CRD requires it in mode KEDA
        raise ValueError("autoscaling.engine.prometheus is required in mode KEDA")
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(m3d, ENGINE),
        "spec": {
            "scaleTargetRef": _scale_target(m3d),
            "pollingInterval": KEDA_POLLING_INTERVAL_SECONDS,
            # KEDA applies the cooldown to the last step, N -> 0, only; behavior covers the rest.
            "cooldownPeriod": scaling.scale_down_delay_seconds,
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(scaling)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": scaling.prometheus.server_address,
                        "query": scaling.prometheus.query or default_query(m3d),
                        "threshold": f"{target_inflight_per_engine(scaling):g}",
                    },
                }
            ],
        },
    }


def horizontal_pod_autoscaler(
    m3d: M3Deployment,
    component: str,
    target: dict[str, str],
    replicas: tuple[int, int],
    metric: dict[str, Any],
    scaling_behavior: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler of one component: ``target`` (a ``scaleTargetRef``) between
    ``replicas`` (min, max) on one ``metric``, with the HPA's default behavior unless given."""
    spec: dict[str, Any] = {
        "scaleTargetRef": target,
        "minReplicas": replicas[0],
        "maxReplicas": replicas[1],
        "metrics": [metric],
    }
    if scaling_behavior is not None:
        spec["behavior"] = scaling_behavior
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(m3d, component),
        "spec": spec,
    }


def engine_autoscaler(m3d: M3Deployment) -> dict[str, Any]:
    scaling = m3d.spec.engine_autoscaling
    inflight = {
        "type": "Object",
        "object": {
            "describedObject": {"apiVersion": "v1", "kind": "Service", "name": child_name(m3d, GATEWAY)},
            "metric": {"name": INFLIGHT},
            "target": {"type": "AverageValue", "averageValue": quantity(target_inflight_per_engine(scaling))},
        },
    }
    return horizontal_pod_autoscaler(m3d, ENGINE, _scale_target(m3d), (scaling.min_replicas, scaling.max_replicas),
                                     inflight, behavior(scaling))  # fmt: skip
