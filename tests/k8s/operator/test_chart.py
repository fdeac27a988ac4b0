"""The Helm chart without a cluster: lint, values schema, RBAC equal to what the operator does, the
operator Deployment, the CRD copy.  (Installing it on the control plane: test_operator.py.)"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import controlplane
import pytest
import yaml

from m3stack import __version__
from m3stack.cli import build_parser
from m3stack.operator import crd
from m3stack.operator.apply import REQUIRED_RULES
from m3stack.operator.render import Images, render_children
from m3stack.operator.spec import M3Deployment

CHART = Path(__file__).resolve().parents[3] / "helm" / "m3stack"


@pytest.fixture(scope="module")
def helm() -> Path:
    return controlplane.binaries_dir(build=False) / "bin" / "helm"


def _helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def _template(helm: Path, *args: str) -> list[dict]:
    result = _helm(helm, "template", "m3", str(CHART), "--namespace", "m3-system", *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _one(docs: list[dict], kind: str, namespace: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"].get("namespace") == namespace]
    return doc


def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


REQUIRED = {
    (rule.api_group, resource, verb) for rule in REQUIRED_RULES for resource in rule.resources for verb in rule.verbs
}
CLUSTER_SCOPED = {grant for grant in REQUIRED if grant[1] in ("customresourcedefinitions", "namespaces")}


def test_chart_testing_lint():
    """ct lint: Chart.yaml schema, yamllint of every YAML file, helm lint."""
    tools = controlplane.binaries_dir(build=False)
    # ct runs helm from PATH, and yamllint and yamale from this environment.
    path = os.pathsep.join([str(tools / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]])
    result = subprocess.run(
        [
            str(tools / "bin" / "ct"), "lint", "--charts", str(CHART),
            "--check-version-increment=false", "--validate-maintainers=false",
            "--chart-yaml-schema", str(tools / "share" / "ct" / "chart_schema.yaml"),
            "--lint-conf", str(tools / "share" / "ct" / "lintconf.yaml"),
        ],
        capture_output=True, text=True, timeout=300, cwd=CHART.parents[1],
        env={**os.environ, "PATH": path},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All charts linted successfully" in result.stdout


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a,team-b}"], ["--set", "crds.install=false"]])
def test_lint_strict(helm, values):
    result = _helm(helm, "lint", "--strict", str(CHART), *values)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cluster_wide_rbac_is_exactly_what_the_operator_does(helm):
    docs = _template(helm)
    assert _grants(_one(docs, "ClusterRole")["rules"]) == REQUIRED
    binding = _one(docs, "ClusterRoleBinding")
    service_account = _one(docs, "ServiceAccount", "m3-system")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": service_account, "namespace": "m3-system"}]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def test_namespaced_rbac_grants_the_cluster_only_the_crd_and_namespace_watch(helm):
    docs = _template(helm, "--set", "watchNamespaces={team-a,team-b}")
    assert _grants(_one(docs, "ClusterRole")["rules"]) == CLUSTER_SCOPED
    for namespace in ("team-a", "team-b"):
        assert _grants(_one(docs, "Role", namespace)["rules"]) | CLUSTER_SCOPED == REQUIRED
        assert _one(docs, "RoleBinding", namespace)["roleRef"]["kind"] == "Role"
    args = _operator_args(docs)
    assert args.namespace == ("team-a", "team-b")


def _operator_args(docs: list[dict]) -> argparse.Namespace:
    (container,) = _one(docs, "Deployment", "m3-system")["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args(container["args"])


def test_the_operator_deployment(helm):
    docs = _template(helm)
    deployment = _one(docs, "Deployment", "m3-system")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/m3stack/operator:{__version__}"
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert pod["serviceAccountName"] == _one(docs, "ServiceAccount", "m3-system")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    args = _operator_args(docs)
    assert args.command == "operator"
    assert args.namespace is None or args.namespace == ()
    assert args.liveness_port == {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
    assert args.engine_image == f"ghcr.io/m3stack/engine:{__version__}"
    assert args.gateway_image == f"ghcr.io/m3stack/gateway:{__version__}"


def test_chart_and_package_versions_agree():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__


def test_the_crd_ships_with_the_chart_and_can_be_left_out(helm):
    assert _one(_template(helm), "CustomResourceDefinition") == crd.crd_manifest()
    assert not [d for d in _template(helm, "--set", "crds.install=false") if d["kind"] == "CustomResourceDefinition"]


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "workers=0"], "workers"),
        (["--set", "logLevel=LOUD"], "logLevel"),
        (["--set", "replicaCount=2"], "replicaCount"),
        (["--set", "watchNamespaces={Team_A}"], "watchNamespaces"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    ],
)
def test_values_schema_refuses_bad_values(helm, values, complaint):
    result = _helm(helm, "template", "m3", str(CHART), *values)
    assert result.returncode != 0
    assert complaint in result.stderr


def test_the_example_renders():
    example = yaml.safe_load((CHART / "examples" / "m3deployment.yaml").read_text())
    example["metadata"].update(namespace="default", uid="u", generation=1)
    children = render_children(M3Deployment.from_body(example), Images("e", "g"))
    assert {child["kind"] for child in children} >= {"Deployment", "Service", "ConfigMap"}
