"""The chart's gatewayDefaults on the real control plane: the operator started with the flags the chart renders
fills the gateway settings a stored M3Deployment leaves unset, and keeps the ones it sets, even to the gateway's
own default values (the CRD defaults none of them, so the API server keeps unset apart from default)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from m3d_testkit import CHART, Kube, OperatorProcess, m3deployment, wait_for

from m3stack.cli import build_parser
from m3stack.gateway.api.request_limits import DEFAULT_MAX_REQUEST_BYTES

GATEWAY_DEFAULTS = {
    "thinkingMode": "Disabled",
    "rateLimits": {"requestsPerSecond": 2.5, "tokensPerMinute": 3_000_000},
    "limits": {"maxRequestBytes": 3 * 2**30, "maxRequestPrompts": 32},
}


def _chart_gateway_flags(k8s_cluster, tmp_path) -> list[str]:
    """The operator's --gateway-* flags as `helm template` renders them from GATEWAY_DEFAULTS."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"gatewayDefaults": GATEWAY_DEFAULTS}))
    rendered = k8s_cluster.run([str(k8s_cluster.binary("helm")), "template", "m3", str(CHART), "-f", str(values)])
    (operator,) = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc and doc["kind"] == "Deployment"]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    flags = [arg for arg in container["args"] if arg.startswith("--gateway-") and not arg.startswith("--gateway-image")]
    assert len(flags) == 5, flags
    return flags


def _gateway_settings(kube: Kube, name: str) -> argparse.Namespace:
    """What the resource's gateway pods would run with: its ConfigMap parsed by the real `m3stack gateway`."""
    config = wait_for(f"ConfigMap {name}-config", lambda: kube.try_json("get", "configmap", f"{name}-config"))
    with pytest.MonkeyPatch.context() as environment:
        for variable, value in config["data"].items():
            environment.setenv(variable, value)
        return build_parser().parse_args(["gateway"])


def test_chart_defaults_fill_only_what_the_resource_leaves_unset(
    k8s_cluster, kube: Kube, operator: OperatorProcess, tmp_path
):
    operator.start(extra_args=tuple(_chart_gateway_flags(k8s_cluster, tmp_path)))
    kube.apply(m3deployment("inherits"))
    own = {
        "thinkingMode": "Adaptive",
        "rateLimits": {"requestsPerSecond": 0},
        "limits": {"maxRequestBytes": DEFAULT_MAX_REQUEST_BYTES},
    }
    kube.apply(m3deployment("own", {"gateway": own}))

    stored = kube.m3d("inherits")["spec"]["gateway"]
    assert "thinkingMode" not in stored, "the API server wrote a default over an unset field"
    assert not stored.get("rateLimits") and not stored.get("limits")
    assert kube.m3d("own")["spec"]["gateway"]["rateLimits"] == {"requestsPerSecond": 0}

    inherits = _gateway_settings(kube, "inherits")
    assert (inherits.thinking_mode, inherits.rate_limit_rps, inherits.rate_limit_tpm) == ("disabled", 2.5, 3_000_000)
    assert (inherits.max_request_bytes, inherits.max_request_prompts) == (3 * 2**30, 32)
    mine = _gateway_settings(kube, "own")
    assert (mine.thinking_mode, mine.rate_limit_rps, mine.rate_limit_tpm) == ("adaptive", 0, 3_000_000)
    assert (mine.max_request_bytes, mine.max_request_prompts) == (DEFAULT_MAX_REQUEST_BYTES, 32)
