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
from m3stack.operator.cli import gateway_defaults
from m3stack.operator.leader import LEADER_ELECTION_RULES
from m3stack.operator.render import Images, render_children
from m3stack.operator.render.flags import GatewayDefaults
from m3stack.operator.spec import M3Deployment, RateLimits, RequestLimits

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
    """The one release object (not a `helm test` hook) of this kind in this namespace."""
    (doc,) = [
        d
        for d in docs
        if d["kind"] == kind
        and d["metadata"].get("namespace") == namespace
        and "helm.sh/hook" not in d["metadata"].get("annotations", {})
    ]
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
LEADER_ELECTION = {
    (rule.api_group, resource, verb)
    for rule in LEADER_ELECTION_RULES
    for resource in rule.resources
    for verb in rule.verbs
}


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
    # Besides, only the Lease of leader election, in the operator's own namespace.
    assert _grants(_one(docs, "Role", "m3-system")["rules"]) == LEADER_ELECTION
    lease_binding = _one(docs, "RoleBinding", "m3-system")
    assert lease_binding["subjects"] == binding["subjects"]
    assert lease_binding["roleRef"]["name"] == _one(docs, "Role", "m3-system")["metadata"]["name"]


def test_without_leader_election_one_replica_and_no_lease_rights(helm):
    docs = _template(helm, "--set", "leaderElection.enabled=false")
    deployment = _one(docs, "Deployment", "m3-system")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert not _operator_args(docs).leader_election


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
    # Two replicas, one leading: a rolling update starts the new one before the old one hands the Lease over.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    anti_affinity = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert (
        anti_affinity[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    (container,) = pod["containers"]
    assert container["image"] == f"localhost/m3stack/operator:{__version__}", "what `scripts/dev images` tags"
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert pod["serviceAccountName"] == _one(docs, "ServiceAccount", "m3-system")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    args = _operator_args(docs)
    assert args.command == "operator"
    assert args.namespace is None or args.namespace == ()
    assert args.liveness_port == {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
    assert args.leader_election and args.leader_election_lease == "m3-m3stack"
    env = {variable["name"]: variable["valueFrom"]["fieldRef"]["fieldPath"] for variable in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert args.engine_image == f"localhost/m3stack/engine:{__version__}"
    assert args.gateway_image == f"localhost/m3stack/gateway:{__version__}"


def test_default_images_follow_the_repository_and_tag_values(helm):
    values = ["defaultImages.repository=registry.test/m3", "defaultImages.tag=v7",
              "defaultImages.engine=registry.test/gpu/engine:7-cuda"]  # fmt: skip
    args = _operator_args(_template(helm, *(arg for value in values for arg in ("--set", value))))
    assert args.engine_image == "registry.test/gpu/engine:7-cuda"
    assert args.gateway_image == "registry.test/m3/gateway:v7"


def test_gateway_defaults_reach_the_operator_only_when_set(helm, tmp_path):
    """Values left empty pass no flag (the gateway's own defaults); set ones arrive exactly, big numbers too."""
    assert gateway_defaults(_operator_args(_template(helm))) == GatewayDefaults()
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "gatewayDefaults": {
                    "thinkingMode": "Disabled",
                    "rateLimits": {"requestsPerSecond": 2.5, "tokensPerMinute": 3_000_000, "concurrentRequests": 0},
                    "limits": {"maxRequestBytes": 3 * 2**30, "maxRequestPrompts": 32},
                }
            }
        )
    )
    assert gateway_defaults(_operator_args(_template(helm, "--values", str(values)))) == GatewayDefaults(
        thinking_mode="Disabled",
        limits=RequestLimits(max_request_bytes=3 * 2**30, max_request_prompts=32),
        rate_limits=RateLimits(requests_per_second=2.5, tokens_per_minute=3_000_000, concurrent_requests=0),
    )


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
        (["--set", "defaultImages.repository="], "repository"),
        (["--set", "gatewayDefaults.thinkingMode=disabled"], "thinkingMode"),
        (["--set", "gatewayDefaults.limits.maxRequestBytes=0"], "maxRequestBytes"),
        (["--set", "gatewayDefaults.rateLimits.tokensPerMinute=-1"], "tokensPerMinute"),
        (["--set", "gatewayDefaults.rateLimits.burst=2"], "burst"),
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


def test_the_grafana_dashboard_ships_for_the_sidecar(helm):
    docs = _template(helm)
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["m3stack.json"] == (CHART / "files" / "dashboards" / "m3stack.json").read_text()
    without = _template(helm, "--set", "monitoring.grafanaDashboard.enabled=false")
    assert not [d for d in without if d["kind"] == "ConfigMap"]


def test_service_monitors_follow_the_values(helm):
    args = _operator_args(_template(helm, "--set", "monitoring.serviceMonitor.labels.release=kps"))
    assert args.service_monitor and args.service_monitor_labels == {"release": "kps"}
    assert not _operator_args(_template(helm, "--set", "monitoring.serviceMonitor.enabled=false")).service_monitor
    # The operator's own metrics: a Service always, a ServiceMonitor only where the cluster serves them.
    assert not [d for d in _template(helm) if d["kind"] == "ServiceMonitor"]
    docs = _template(helm, "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    service = _one(docs, "Service", "m3-system")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "http"


def test_the_helm_test_hook_probes_the_watched_namespaces_with_read_only_rights(helm):
    docs = _template(helm, "--set", "watchNamespaces={team-a,team-b}")
    hooks = [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    (pod,) = [d for d in hooks if d["kind"] == "Pod"]
    (container,) = pod["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "probe" and args.discover and args.namespace == ("team-a", "team-b")
    (role,) = [d for d in hooks if d["kind"] == "ClusterRole"]
    assert _grants(role["rules"]) == {("m3stack.io", "m3deployments", "list")}
    assert (
        pod["spec"]["serviceAccountName"] == next(d for d in hooks if d["kind"] == "ServiceAccount")["metadata"]["name"]
    )
    assert not [d for d in _template(helm, "--set", "tests.enabled=false") if d["kind"] == "Pod"]
