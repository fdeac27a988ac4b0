"""The M3Deployment CRD: generated copy up to date, structural, defaults as designed, subresources wired.

The API server itself (CEL compilation, refusals of invalid resources) is exercised in
tests/k8s/operator/test_validation.py; these checks need no cluster.
"""

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from m3stack.operator import crd
from m3stack.operator.schema import apply_defaults
from m3stack.operator.spec_schema import SPEC_SCHEMA


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _root_schema() -> dict[str, Any]:
    return crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _schema_at(path: str) -> dict[str, Any]:
    node = _root_schema()
    for part in path.strip(".").split("."):
        if node.get("type") == "array":
            node = node["items"]
        node = node["properties"][part]
    return node


def test_the_chart_holds_the_generated_crd(repo_root):
    assert (
        crd.main(["--check", "--output", str(repo_root / "helm/m3stack/files/crds/m3deployments.m3stack.io.yaml")]) == 0
    )


def test_check_fails_on_a_stale_copy(tmp_path):
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd.crd_yaml().replace("maxReplicas", "maxReplicaz"))
    assert crd.main(["--check", "--output", str(stale)]) == 1
    assert crd.main(["--output", str(stale)]) == 0
    assert crd.main(["--check", "--output", str(stale)]) == 0
    assert yaml.safe_load(stale.read_text()) == crd.crd_manifest()


def test_schema_is_structural_and_bounded():
    """Every node is typed (or an int-or-string / preserved object), described, and every string and
    list is bounded, which CEL's cost estimator needs."""
    problems = []
    for path, node in _walk(_root_schema()):
        if path in (".metadata", ".apiVersion", ".kind"):
            continue
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        if not typed:
            problems.append(f"{path}: no type")
        if "description" not in node and not path.endswith(("[]", "{}")):
            problems.append(f"{path}: no description")
        if node.get("type") == "string" and "maxLength" not in node and node.get("format") != "date-time":
            problems.append(f"{path}: unbounded string")
        if node.get("type") == "array" and "maxItems" not in node:
            problems.append(f"{path}: unbounded list")
        if (
            node.get("type") == "object"
            and not (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            )
            and path != ""
        ):
            problems.append(f"{path}: object without a schema")
    assert problems == []


def test_every_default_satisfies_its_own_schema():
    for path, node in _walk(_root_schema()):
        if "default" not in node:
            continue
        default = node["default"]
        if "enum" in node:
            assert default in node["enum"], path
        if "minimum" in node:
            assert default >= node["minimum"], path
        if "maximum" in node:
            assert default <= node["maximum"], path
        if "pattern" in node and isinstance(default, str):
            assert re.match(node["pattern"], default), path


def test_defaults_of_a_minimal_spec_are_the_designed_ones():
    spec = apply_defaults(SPEC_SCHEMA, {"model": {"name": "m3"}})
    assert spec["suspend"] is False
    assert spec["model"] == {"name": "m3", "path": "default"}
    engine = spec["engine"]
    assert engine["replicas"] == 1
    assert engine["accelerator"] == {"resource": "nvidia.com/gpu", "count": 1}
    assert (engine["grpcPort"], engine["metricsPort"]) == (50051, 9400)
    assert engine["drain"] == {"preStopSeconds": 15, "shutdownTimeoutSeconds": 300}
    assert engine["startup"] == {"timeoutSeconds": 1800}
    assert engine["kvCache"] == {"cpuOffload": {"size": "0"}, "indexDtype": "auto", "dtype": "auto"}
    assert "maxModelLen" not in engine and "gpuMemoryUtilization" not in engine, "left to the engine's own defaults"
    assert engine["shmSize"] == "16Gi"
    assert spec["gateway"]["replicas"] == 2
    assert spec["gateway"]["port"] == 8000
    autoscaling = spec["autoscaling"]
    assert autoscaling["engine"]["mode"] == "None"
    assert (autoscaling["engine"]["stableWindowSeconds"], autoscaling["engine"]["panicWindowSeconds"]) == (180, 60)
    assert autoscaling["engine"]["scaleDownDelaySeconds"] == 300
    assert autoscaling["gateway"]["enabled"] is False
    assert spec["exposure"] == {"service": {"type": "ClusterIP"}}


def test_defaulting_keeps_given_values_fills_list_items_and_leaves_the_input_alone():
    given = {
        "model": {"name": "m3", "pvc": {"claimName": "models"}},
        "engine": {"replicas": 4, "tolerations": [{"key": "gpu"}], "env": [{"name": "A", "value": "1"}]},
        "exposure": {"ingress": {"host": "m3.example.com"}},
    }
    before = copy.deepcopy(given)
    spec = apply_defaults(SPEC_SCHEMA, given)
    assert given == before
    assert spec["engine"]["replicas"] == 4
    assert spec["model"]["pvc"] == {"claimName": "models", "mountPath": "/models"}
    assert spec["engine"]["tolerations"] == [{"key": "gpu"}]
    assert spec["exposure"]["ingress"] == {"host": "m3.example.com", "path": "/"}
    assert "tls" not in spec["exposure"]["ingress"]


def test_scale_subresource_and_printer_columns_point_at_real_fields():
    version = crd.crd_manifest()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.engine.replicas"
    assert _schema_at(scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["labelSelectorPath"])["type"] == "string"
    assert version["subresources"]["status"] == {}
    for column in version["additionalPrinterColumns"]:
        path = re.sub(r"\[\?.*?\]", "", column["jsonPath"])
        if path.startswith(".metadata"):
            continue
        assert column["type"] == _schema_at(path)["type"], column


def test_names_and_rules():
    manifest = crd.crd_manifest()
    assert manifest["metadata"]["name"] == "m3deployments.m3stack.io"
    assert manifest["spec"]["names"]["shortNames"] == ["m3d"]
    assert manifest["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    rules = [rule for _, node in _walk(_root_schema()) for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    assert all(rule["message"] and rule["rule"] for rule in rules)


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("tiny", True),
        ("m3-prod-2", True),
        ("a" * crd.MAX_NAME_LENGTH, True),
        ("a" * (crd.MAX_NAME_LENGTH + 1), False),
        ("2fast", False),
        ("Upper", False),
        ("trailing-", False),
    ],
)
def test_name_rule_pattern(name, valid):
    """The same pattern the root CEL rule uses; the API server applies it in the k8s tests."""
    assert (bool(re.fullmatch(crd.DNS_1035_PATTERN, name)) and len(name) <= crd.MAX_NAME_LENGTH) == valid
