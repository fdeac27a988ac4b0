"""Fixtures for tests on the real node (tests/k8s/infra/realnode.py): every pod here really runs.

- ``real_kube`` (function): kubectl (Kube from the operator tests' kit) in a fresh namespace of the
  real-node cluster, deleted and waited for after the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from realnode import RealCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_kit, the serving tests' helpers
from m3d_testkit import Kube


@pytest.fixture
def real_kube(k8s_real_cluster: RealCluster, k8s_real_namespace: str) -> Kube:
    return Kube(k8s_real_cluster.plane, k8s_real_namespace)
