"""The built-in engine autoscaler on the real node (#27 item 4): the chart's operator runs as a pod and reads
the in-flight counts of the gateway pods from their pod IPs (the chart passes no metrics URLs: discovery by
the gateway Service's pods), and scales the engines of a real M3Deployment up under load and back down.

The operator as a pod rather than a host process: discovery must find the gateways where any in-cluster
operator would, at pod IP and gateway port from inside the pod network, with the chart's RBAC.  Windows are
short (stable 12 s, panic 4 s, no scale-down delay) so the test takes a few minutes on the shared node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from m3d_testkit import wait_for
from realnode import RealCluster
from serving_kit import (
    READY_TIMEOUT_S,
    Served,
    SteadyLoad,
    latency_summary,
    module_deployment,
    operator_pod,
)

from m3stack.operator.render.names import ENGINE, GATEWAY

log = logging.getLogger(__name__)

TARGET = 1  # in-flight requests one engine is sized for (at utilization 1)
LOAD = 3  # requests held in flight: 3 engines wanted, capped at maxReplicas 2
SPEC = {
    "gateway": {"routing": {"policy": "LeastInflight"}},
    "autoscaling": {
        "engine": {
            "mode": "Builtin",
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetConcurrency": TARGET,
            "targetUtilization": 1.0,
            "stableWindowSeconds": 12,
            "panicWindowSeconds": 4,
            "scaleDownDelaySeconds": 0,
        }
    },
}


@pytest.fixture(scope="module")
def stack(k8s_real_cluster: RealCluster) -> Iterator[Served]:
    with module_deployment(k8s_real_cluster, "autoscale", SPEC) as stack:
        yield stack


def _autoscaling(stack: Served) -> dict[str, Any]:
    return stack.kube.m3d(stack.name).get("status", {}).get("autoscaling", {})


def _decision(stack: Served, from_replicas: int, to_replicas: int) -> dict[str, Any] | None:
    decisions = _autoscaling(stack).get("recentDecisions", [])
    return next((d for d in decisions if (d["fromReplicas"], d["toReplicas"]) == (from_replicas, to_replicas)), None)


def _busy(stack: Served) -> dict[str, Any] | None:
    autoscaling = _autoscaling(stack)
    return autoscaling if autoscaling.get("observedConcurrency", 0) > TARGET else None


def test_autoscaler_scales_engines_from_gateway_pod_metrics(stack: Served) -> None:
    operator = operator_pod(stack.cluster)["spec"]["containers"][0]
    assert not [arg for arg in operator["args"] if arg.startswith("--autoscaler-metrics-urls")]
    assert not [var for var in operator.get("env", []) if var["name"] == "M3STACK_OPERATOR_AUTOSCALER_METRICS_URLS"]
    gateway_ips = {pod["status"]["podIP"] for pod in stack.ready_pods(GATEWAY)}
    stack.wait_engines(1)

    def both_gateways_read() -> dict[str, Any] | None:
        autoscaling = _autoscaling(stack)
        return autoscaling if autoscaling.get("gatewaysScraped") == 2 else None

    idle = wait_for("the autoscaler to read both gateways", both_gateways_read)
    assert idle["gatewayTargets"] == 2 and idle["desiredReplicas"] == 1, idle

    with SteadyLoad(stack, workers=LOAD, max_tokens=96, ignore_eos=True) as load:
        started = time.monotonic()
        up = wait_for("the scale-up decision", lambda: _decision(stack, 1, 2), timeout_s=120, interval_s=1.0)
        decided_s = time.monotonic() - started
        engines = stack.wait_engines(2, READY_TIMEOUT_S)
        engine_ready_s = time.monotonic() - started
        stack.gateways_see({pod["status"]["podIP"] for pod in engines})
        routed_s = time.monotonic() - started
        # The stable-window mean of the in-flight counts summed over both gateway pods; status.autoscaling
        # refreshes it every 10 s, decisions at once.
        loaded = wait_for("the observed concurrency to reach the load", lambda: _busy(stack), 30, 1.0)
        time.sleep(5)  # the load runs on both engines a while
    stopped = time.monotonic()
    outcomes = load.outcomes
    down = wait_for("the scale-down decision", lambda: _decision(stack, 2, 1), timeout_s=180, interval_s=1.0)
    down_s = time.monotonic() - stopped
    stack.wait_engines(1, timeout_s=120)
    gone_s = time.monotonic() - stopped

    lost = [o for o in outcomes if not o.ok]
    condition = stack.kube.condition(stack.name, "AutoscalingActive")
    log.info(
        "autoscaler (operator pod, gateway pods %s scraped by pod IP): %d requests held in flight; scale-up 1 -> 2 "
        "decided %.1f s after the load began (%s mode), second engine Ready after %.1f s, in "
        "every gateway's pool after %.1f s, observed concurrency then %.2f (panic window %.2f); load stopped: "
        "scale-down 2 -> 1 decided after %.1f s, one engine pod left (the other terminating) after %.1f s; "
        "%d requests, %d lost; %s; condition: %s",
        sorted(gateway_ips), LOAD, decided_s, up["state"], engine_ready_s, routed_s, loaded["observedConcurrency"],
        loaded["panicConcurrency"], down_s, gone_s, len(outcomes), len(lost), latency_summary(outcomes),
        condition.get("message"),
    )  # fmt: skip
    assert loaded["gatewayTargets"] == 2 and loaded["gatewaysScraped"] == 2, loaded
    assert not lost, f"{len(lost)} requests lost while the engines scaled: {lost[:5]}"
    assert down["observedConcurrency"] <= TARGET, down
    assert len(stack.pods(ENGINE)) == 1
