"""Invalid M3Deployments are refused by the API server itself (schema, enums, CEL), with messages that
say what to fix.  No operator runs here: validation must not depend on it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import controlplane
import pytest
from m3d_testkit import Kube, m3deployment

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("min-over-max", {"autoscaling": {"engine": {"minReplicas": 5, "maxReplicas": 2}}},
     "autoscaling.engine.minReplicas must be <= maxReplicas"),
    ("gateway-min-over-max", {"autoscaling": {"gateway": {"minReplicas": 9, "maxReplicas": 3}}},
     "autoscaling.gateway.minReplicas must be <= maxReplicas"),
    ("panic-over-stable", {"autoscaling": {"engine": {"stableWindowSeconds": 60, "panicWindowSeconds": 120}}},
     "panicWindowSeconds must be <= stableWindowSeconds"),
    ("unknown-mode", {"autoscaling": {"engine": {"mode": "Magic"}}}, 'Unsupported value: "Magic"'),
    ("negative-replicas", {"engine": {"replicas": -1}}, "should be greater than or equal to 0"),
    ("relative-model-path", {"model": {"path": "models/m3"}}, "must be an absolute path or 'default'"),
    ("path-outside-claim", {"model": {"path": "/elsewhere/m3", "pvc": {"claimName": "weights"}}},
     "model.path must lie under model.pvc.mountPath"),
    ("product-without-gpu", {"engine": {"accelerator": {"count": 0, "product": "NVIDIA-H200"}}},
     "accelerator.product needs accelerator.count > 0"),
    ("tensor-over-gpus", {"engine": {"accelerator": {"count": 2}, "parallelism": {"tensor": 4}}},
     "parallelism.tensor must not exceed accelerator.count"),
    ("same-ports", {"engine": {"grpcPort": 9400}}, "engine.grpcPort and engine.metricsPort must differ"),
    ("bad-offload-size", {"engine": {"kvCache": {"cpuOffload": {"size": "lots"}}}}, "should match"),
    ("bad-kernel-cache-claim", {"engine": {"kernelCache": {"claimName": "Not_A_Name"}}}, "should match"),
    ("tls-without-host", {"exposure": {"ingress": {"tls": {"secretName": "cert"}}}},
     "exposure.ingress.tls needs exposure.ingress.host"),
    ("bad-routing", {"gateway": {"routing": {"policy": "Random"}}}, 'Unsupported value: "Random"'),
    ("utilization-over-one", {"autoscaling": {"engine": {"targetUtilization": 1.5}}},
     "should be less than or equal to 1"),
    ("zero-context", {"engine": {"maxModelLen": 0}},
     "spec.engine.maxModelLen in body should be greater than or equal to 1"),
    ("fractional-context", {"engine": {"maxModelLen": 1.5}}, "spec.engine.maxModelLen in body must be of type int32"),
    ("zero-memory-utilization", {"engine": {"gpuMemoryUtilization": 0}},
     "spec.engine.gpuMemoryUtilization in body should be greater than 0"),
    ("memory-utilization-over-one", {"engine": {"gpuMemoryUtilization": 1.5}},
     "spec.engine.gpuMemoryUtilization in body should be less than or equal to 1"),
    ("context-field-and-flag", {"engine": {"maxModelLen": 4096, "extraArgs": ["--max-model-len", "8192"]}},
     "set engine.maxModelLen or --max-model-len in engine.extraArgs, not both"),
    ("memory-utilization-field-and-flag",
     {"engine": {"gpuMemoryUtilization": 0.8, "extraArgs": ["--gpu-memory-utilization=0.95"]}},
     "set engine.gpuMemoryUtilization or --gpu-memory-utilization in engine.extraArgs, not both"),
    ("env-value-and-source",
     {"engine": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}},
     "set value or valueFrom, not both"),
]  # fmt: skip


@pytest.fixture(scope="module")
def kube(k8s_cluster, chart) -> Iterator[Kube]:
    """One namespace for the whole module: every test uses its own resource name."""
    namespace = f"t-validation-{secrets.token_hex(3)}"
    k8s_cluster.kubectl("create", "namespace", namespace)
    yield Kube(k8s_cluster, namespace)
    k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def _create(kube, manifest: dict[str, Any]) -> str:
    """The API server's answer to a create: its error message, or '' when it accepted the object."""
    try:
        kube("create", "-f", "-", input=json.dumps(manifest))
    except controlplane.ControlPlaneError as error:
        return str(error)
    return ""


@pytest.mark.parametrize(("case", "spec", "message"), INVALID, ids=[case for case, _, _ in INVALID])
def test_invalid_resources_are_refused_with_a_clear_message(kube, chart, case, spec, message):
    answer = _create(kube, m3deployment(f"bad-{case}", spec))
    assert message in answer, answer
    assert kube.try_json("get", "m3deployment", f"bad-{case}") is None, "nothing was stored"


def test_the_resource_needs_a_model_name(kube, chart):
    manifest = m3deployment("nameless")
    del manifest["spec"]["model"]["name"]
    assert "spec.model.name: Required value" in _create(kube, manifest)


@pytest.mark.parametrize("name", ["a" * 51, "9lives"])
def test_names_that_cannot_name_the_children_are_refused(kube, chart, name):
    assert "metadata.name must be a DNS-1035 label" in _create(kube, m3deployment(name))


def test_a_valid_resource_is_accepted_and_defaulted(kube, chart):
    assert _create(kube, m3deployment("fine")) == ""
    spec = kube.json("get", "m3d", "fine")["spec"]
    assert spec["engine"]["drain"] == {"preStopSeconds": 15, "shutdownTimeoutSeconds": 300}
    assert spec["autoscaling"]["engine"]["mode"] == "None"
    assert spec["gateway"]["routing"]["policy"] == "PrefixAware"
    assert spec["engine"]["kernelCache"] == {}  # the pod's /tmp unless a claim is named
    assert _create(kube, m3deployment("cached", {"engine": {"kernelCache": {"claimName": "kernels"}}})) == ""


def test_engine_sizing_as_fields_or_as_flags_is_accepted(kube, chart):
    sized = {"maxModelLen": 131072, "gpuMemoryUtilization": 1, "extraArgs": ["--max-num-seqs", "32"]}
    assert _create(kube, m3deployment("sized", {"engine": sized})) == ""
    stored = kube.json("get", "m3d", "sized")["spec"]["engine"]
    assert (stored["maxModelLen"], stored["gpuMemoryUtilization"]) == (131072, 1)
    flags = ["--max-model-len", "131072", "--gpu-memory-utilization=0.85"]
    assert _create(kube, m3deployment("flagged", {"engine": {"extraArgs": flags}})) == ""
    assert _create(kube, m3deployment("unsized")) == ""
    assert not {"maxModelLen", "gpuMemoryUtilization"} & set(kube.json("get", "m3d", "unsized")["spec"]["engine"])


def test_scaling_through_the_subresource_is_validated_too(kube, chart):
    assert _create(kube, m3deployment("scalable")) == ""
    with pytest.raises(controlplane.ControlPlaneError, match="greater than or equal to 0"):
        kube("patch", "m3d", "scalable", "--subresource=scale", "--type=merge", "-p", '{"spec":{"replicas":-3}}')
