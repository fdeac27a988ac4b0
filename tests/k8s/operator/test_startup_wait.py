"""The operator waits, at INFO and without retry ERRORs, until the API server serves its CRD: a helm install
creates the CRD and starts the operator together, and kopf's first watch of a CRD whose storage was still
initializing logged an ERROR.  Here a throwaway CRD is created two seconds after the wait began, on the real
API server."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time

import pytest
from controlplane import ControlPlane, namespaced_crd
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from m3stack.operator.apply import Cluster
from m3stack.operator.runner import wait_until_served

CRD_DELAY_S = 2.0


def test_the_wait_returns_once_a_crd_created_later_lists(
    k8s_cluster: ControlPlane, k8s_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    group = f"wait{secrets.token_hex(4)}.test.m3stack.dev"
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(k8s_cluster.kubeconfig), client_configuration=configuration)
    cluster = Cluster(k8s.ApiClient(configuration))
    path = f"/apis/{group}/v1/namespaces/{k8s_namespace}/widgets"
    created_at: list[float] = []

    def create_later() -> None:
        time.sleep(CRD_DELAY_S)
        created_at.append(time.monotonic())
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(namespaced_crd(group, "widgets", "Widget")))

    creator = threading.Thread(target=create_later)
    started = time.monotonic()
    creator.start()
    try:
        with caplog.at_level(logging.INFO, logger="m3stack.operator.runner"):
            asyncio.run(asyncio.wait_for(wait_until_served(lambda: cluster._request("GET", path), "widgets"), 60))
        returned = time.monotonic()
        creator.join()
        assert created_at and returned >= created_at[0] >= started + CRD_DELAY_S
        assert cluster._request("GET", path).get("items") == []  # it lists now
        waits = [r for r in caplog.records if "waiting for the API server to serve widgets" in r.getMessage()]
        assert waits and all(r.levelno == logging.INFO for r in waits)
        assert len({r.getMessage() for r in waits}) == len(waits)  # each answer said once, not per retry
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        creator.join()
        k8s_cluster.kubectl("delete", "crd", f"widgets.{group}", "--ignore-not-found")
