"""Fifty M3Deployments at once reconcile to Ready within a bounded time (one operator, 100 pods)."""

from __future__ import annotations

import json
import logging
import time

from m3d_testkit import m3deployment, wait_for

COUNT = 50
# Measured 76-150 s on the 2-core development machine (control plane, operator and other tests on it,
# load 10-12); the bound leaves room for a busier machine, not for an operator that stalls.
BOUND_S = 600.0

logger = logging.getLogger(__name__)


def test_fifty_resources_become_ready_within_a_bounded_time(kube, operator, k8s_node_pool):
    pool = k8s_node_pool(count=7, gpus=8)  # 56 GPUs for 50 one-GPU engines, nobody else's pods
    operator.start(drift_interval_s=60)
    engine = {"nodeSelector": pool.node_selector, "tolerations": [pool.toleration]}
    manifests = [m3deployment(f"m{index:02d}", {"engine": engine}) for index in range(COUNT)]
    started = time.monotonic()
    kube("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))

    def all_ready() -> bool:
        items = kube.json("get", "m3deployments")["items"]
        ready = [
            item
            for item in items
            if item.get("status", {}).get("phase") == "Ready"
            and item["status"].get("observedGeneration") == item["metadata"]["generation"]
        ]
        return len(ready) == COUNT

    wait_for(f"{COUNT} M3Deployments to be Ready", all_ready, timeout_s=BOUND_S, interval_s=2)
    elapsed = time.monotonic() - started
    logger.warning("%d M3Deployments reached Ready in %.1f s", COUNT, elapsed)
    deployments = kube.json("get", "deployments", "-l", "app.kubernetes.io/managed-by=m3stack-operator")["items"]
    assert len(deployments) == 2 * COUNT, "no duplicates"
    engines = kube.json("get", "pods", "-l", "m3stack.io/component=engine")["items"]
    assert len(engines) == COUNT and {pod["spec"]["nodeName"] for pod in engines} <= set(pool.node_names)
