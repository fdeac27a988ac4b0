"""kubeconform validates offline against schemas written from the control plane (infra/kubeconform_schemas.py),
for built-in kinds and for CRDs installed at the time."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from controlplane import ControlPlane, namespaced_crd
from kubeconform_schemas import SCHEMA_LOCATION, write_schemas


def gadget_crd(group: str) -> dict:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {"size": {"type": "integer", "minimum": 1}, "color": {"type": "string"}},
            }
        },
    }
    return namespaced_crd(group, "gadgets", "Gadget", schema)


def deployment(name: str, replicas: object, container_extra: dict) -> dict:
    container = {"name": "c", "image": "registry.invalid/x:0", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container | container_extra]}},
        },
    }


def test_kubeconform_checks_builtin_kinds_and_crds_offline(
    k8s_cluster: ControlPlane, k8s_namespace: str, tmp_path: Path
) -> None:
    group = f"{k8s_namespace}.test.m3stack.io"
    crd = gadget_crd(group)
    k8s_cluster.kubectl("create", "-f", "-", input=json.dumps(crd))
    try:
        k8s_cluster.wait_crd_established(crd["metadata"]["name"])
        schemas = tmp_path / "schemas"
        assert write_schemas(k8s_cluster, schemas, wait_for=[f"{group}/v1"]) > 50

        manifests = {
            "good-deployment": deployment("good-deployment", 2, {}),
            "good-service": {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "good-service"},
                "spec": {"selector": {"app": "x"}, "ports": [{"port": 80, "targetPort": "http"}]},
            },
            "good-gadget": {"apiVersion": f"{group}/v1", "kind": "Gadget", "metadata": {"name": "good-gadget"},
                            "spec": {"size": 2}},
            "replicas-as-text": deployment("replicas-as-text", "three", {}),
            "unknown-field": deployment("unknown-field", 1, {"imagePullPolicyy": "Always"}),
            "gadget-size-as-text": {"apiVersion": f"{group}/v1", "kind": "Gadget",
                                    "metadata": {"name": "gadget-size-as-text"}, "spec": {"size": "big"}},
        }  # fmt: skip
        manifest_file = tmp_path / "manifests.yaml"
        manifest_file.write_text(yaml.safe_dump_all(manifests.values()))
        result = k8s_cluster.run(
            [str(k8s_cluster.binary("kubeconform")), "-strict", "-verbose", "-output", "json",
             "-schema-location", f"{schemas}/{SCHEMA_LOCATION}", str(manifest_file)],
            check=False,
        )  # fmt: skip
    finally:
        k8s_cluster.kubectl("delete", "crd", crd["metadata"]["name"], "--wait=false")

    verdicts = {resource["name"]: resource for resource in json.loads(result.stdout)["resources"]}
    assert set(verdicts) == set(manifests)
    assert {name for name, verdict in verdicts.items() if verdict["status"] == "statusValid"} == {
        "good-deployment",
        "good-service",
        "good-gadget",
    }
    assert "/spec/replicas" in verdicts["replicas-as-text"]["msg"]
    assert "imagePullPolicyy" in verdicts["unknown-field"]["msg"]
    assert "/spec/size" in verdicts["gadget-size-as-text"]["msg"]
    assert result.returncode == 1
