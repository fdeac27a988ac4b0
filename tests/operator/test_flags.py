"""What the pods are told must be what the processes understand: the rendered command lines and
ConfigMap variables go through the real `m3stack` parser (engine/cli.py, gateway/cli.py)."""

import argparse

import pytest

from m3stack.cli import build_parser
from m3stack.gateway.api.request_limits import DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_SEQUENCES
from m3stack.operator.cli import gateway_defaults
from m3stack.operator.render import Images, render_children
from m3stack.operator.render.flags import GatewayDefaults
from m3stack.operator.render.names import CONFIG_HASH_ANNOTATION
from m3stack.operator.spec import M3Deployment, RateLimits, RequestLimits
from m3stack.options import env_name

# The gateway settings an M3Deployment may leave to the operator's defaults (the chart's gatewayDefaults).
TUNABLE_FLAGS = (
    "--thinking-mode",
    "--rate-limit-rps",
    "--rate-limit-tpm",
    "--rate-limit-concurrency",
    "--max-request-bytes",
    "--max-request-prompts",
    "--max-request-sequences",
)

SPEC = {
    "model": {"name": "m3-prod", "path": "/weights/m3", "pvc": {"claimName": "weights", "mountPath": "/weights"}},
    "engine": {
        "grpcPort": 6001,
        "metricsPort": 9401,
        "accelerator": {"count": 2},
        "drain": {"shutdownTimeoutSeconds": 123},
        "maxModelLen": 131072,
        "gpuMemoryUtilization": 0.85,
        "extraArgs": ["--port", "6001"],
    },
    "gateway": {
        "port": 8081,
        "routing": {"policy": "LeastInflight"},
        "drain": {"shutdownTimeoutSeconds": 45},
        "apiKeySecret": {"name": "gateway-keys", "key": "tokens"},
        "extraArgs": ["--max-attempts", "5"],
    },
}


def _rendered(make_m3d, images, component: str, spec: dict = SPEC) -> tuple[list[str], dict[str, str]]:
    children = {(child["kind"], child["metadata"]["name"]): child for child in render_children(make_m3d(spec), images)}
    (container,) = children[("Deployment", f"demo-{component}")]["spec"]["template"]["spec"]["containers"]
    return container["args"], children[("ConfigMap", "demo-config")]["data"]


def _parse(args: list[str], environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parses as the pod would: the ConfigMap's variables in the environment, then the command line."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(args)


def _flags_of(command: str) -> set[str]:
    parser = build_parser()
    (subparsers,) = (action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", ["engine", "gateway"])
def test_every_configmap_variable_names_a_flag_of_its_command(make_m3d, images, command):
    _, data = _rendered(make_m3d, images, command)
    prefix = env_name(command, "")
    ours = {name for name in data if name.startswith(prefix)}
    assert ours, f"no {prefix}* settings rendered"
    known = {env_name(command, flag) for flag in _flags_of(command) if flag.startswith("--")}
    assert ours - known == set(), f"variables `m3stack {command}` would silently ignore"
    assert all(name.startswith((env_name("engine", ""), env_name("gateway", ""))) for name in data)


def test_the_engine_understands_its_pod(make_m3d, images, monkeypatch):
    args, data = _rendered(make_m3d, images, "engine")
    parsed = _parse(args, data, monkeypatch)
    assert parsed.command == "engine"
    assert parsed.model == "/weights/m3"
    assert parsed.device == "cuda"
    assert (parsed.host, parsed.port, parsed.metrics_port) == ("0.0.0.0", 6001, 9401)
    assert parsed.served_model_name == "m3-prod"
    assert parsed.drain_timeout == 123
    assert (parsed.max_model_len, parsed.gpu_memory_utilization) == (131072, 0.85)


def test_unset_engine_sizing_fields_leave_the_engines_own_defaults(make_m3d, images, monkeypatch):
    engine = {key: value for key, value in SPEC["engine"].items() if key not in ("maxModelLen", "gpuMemoryUtilization")}
    args, data = _rendered(make_m3d, images, "engine", {**SPEC, "engine": engine})
    assert not {env_name("engine", "--max-model-len"), env_name("engine", "--gpu-memory-utilization")} & set(data)
    parsed = _parse(args, data, monkeypatch)
    assert (parsed.max_model_len, parsed.gpu_memory_utilization) == (None, 0.9)


def test_the_gateway_understands_its_pod(make_m3d, images, monkeypatch):
    args, data = _rendered(make_m3d, images, "gateway")
    parsed = _parse(args, data, monkeypatch)
    assert parsed.command == "gateway"
    assert parsed.model == "/weights/m3"
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8081)
    assert parsed.engine_service == ("demo-engine.models.svc", 6001)
    assert parsed.api_key_file == "/etc/m3stack/api-keys/tokens"
    assert parsed.served_model_name == "m3-prod"
    assert parsed.routing == "least-inflight"
    assert parsed.drain_timeout == 45
    assert parsed.max_attempts == 5, "extraArgs reach the process"


def test_a_bad_rendered_value_would_be_refused(monkeypatch):
    """The check above can fail: the parser rejects a value of the wrong type from the environment."""
    monkeypatch.setenv(env_name("gateway", "--drain-timeout"), "soon")
    with pytest.raises(SystemExit) as exit_info:
        build_parser()
    assert exit_info.value.code == 2


GATEWAY_DEFAULTS_FLAGS = [
    "--gateway-thinking-mode", "Disabled",
    "--gateway-rate-limit-rps", "2.5", "--gateway-rate-limit-tpm", "3000000", "--gateway-rate-limit-concurrency", "7",
    "--gateway-max-request-bytes", str(16 * 2**20), "--gateway-max-request-prompts", "32",
    "--gateway-max-request-sequences", "96",
]  # fmt: skip


def _gateway_settings(
    m3d: M3Deployment, defaults: GatewayDefaults, monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """The gateway process's settings for ``m3d`` rendered with the operator's ``defaults``."""
    children = {
        (child["kind"], child["metadata"]["name"]): child
        for child in render_children(m3d, Images("e", "g"), gateway_defaults=defaults)
    }
    (container,) = children[("Deployment", "demo-gateway")]["spec"]["template"]["spec"]["containers"]
    return _parse(container["args"], children[("ConfigMap", "demo-config")]["data"], monkeypatch)


def _limits(parsed: argparse.Namespace) -> tuple:
    return (
        parsed.thinking_mode,
        parsed.rate_limit_rps,
        parsed.rate_limit_tpm,
        parsed.rate_limit_concurrency,
        parsed.max_request_bytes,
        parsed.max_request_prompts,
        parsed.max_request_sequences,
    )


def _operator_defaults(flags: list[str]) -> GatewayDefaults:
    return gateway_defaults(build_parser().parse_args(["operator", *flags]))


GATEWAYS_OWN = ("adaptive", 0.0, 0, 0, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_SEQUENCES)


def test_unset_gateway_settings_leave_the_gateways_own_defaults(make_m3d, images, monkeypatch):
    """No CRD default stands in for the gateway's: nothing is rendered, the gateway's own defaults apply."""
    gateway = make_m3d(SPEC).spec.gateway
    assert gateway.thinking_mode is None and gateway.limits == RequestLimits() and gateway.rate_limits == RateLimits()
    _, data = _rendered(make_m3d, images, "gateway")
    assert not {env_name("gateway", flag) for flag in TUNABLE_FLAGS} & set(data)
    assert _limits(_gateway_settings(make_m3d(SPEC), _operator_defaults([]), monkeypatch)) == GATEWAYS_OWN


def test_the_operators_defaults_fill_what_the_resource_leaves_unset(make_m3d, monkeypatch):
    defaults = _operator_defaults(GATEWAY_DEFAULTS_FLAGS)
    assert _limits(_gateway_settings(make_m3d(SPEC), defaults, monkeypatch)) == (
        "disabled", 2.5, 3000000, 7, 16 * 2**20, 32, 96
    )  # fmt: skip


def test_a_field_set_to_the_gateways_default_wins_over_the_operators(make_m3d, monkeypatch):
    """Set is not unset: Adaptive and 0 written in the resource stay, though they equal the gateway's defaults."""
    gateway = {
        "thinkingMode": "Adaptive",
        "rateLimits": {"requestsPerSecond": 0, "concurrentRequests": 0},
        "limits": {"maxRequestBytes": DEFAULT_MAX_REQUEST_BYTES, "maxRequestSequences": DEFAULT_MAX_SEQUENCES},
    }
    spec = {**SPEC, "gateway": {**SPEC["gateway"], **gateway}}
    defaults = _operator_defaults(GATEWAY_DEFAULTS_FLAGS)
    assert _limits(_gateway_settings(make_m3d(spec), defaults, monkeypatch)) == (
        "adaptive", 0, 3000000, 0, DEFAULT_MAX_REQUEST_BYTES, 32, DEFAULT_MAX_SEQUENCES
    )  # fmt: skip


def test_the_resources_own_values_reach_the_gateway(make_m3d, monkeypatch):
    gateway = {
        "thinkingMode": "Enabled",
        "rateLimits": {"requestsPerSecond": 4, "tokensPerMinute": 90000, "concurrentRequests": 3},
        "limits": {"maxRequestBytes": 3 * 2**30, "maxRequestPrompts": 8, "maxRequestSequences": 64},
    }
    spec = {**SPEC, "gateway": {**SPEC["gateway"], **gateway}}
    for defaults in (GatewayDefaults(), _operator_defaults(GATEWAY_DEFAULTS_FLAGS)):
        assert _limits(_gateway_settings(make_m3d(spec), defaults, monkeypatch)) == (
            "enabled",
            4,
            90000,
            3,
            3 * 2**30,
            8,
            64,
        )


def test_changing_an_operator_default_rolls_only_the_gateways(make_m3d, images):
    m3d = make_m3d(SPEC)

    def hashes(defaults: GatewayDefaults) -> dict[str, str]:
        return {
            child["metadata"]["name"]: child["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
            for child in render_children(m3d, images, gateway_defaults=defaults)
            if child["kind"] == "Deployment"
        }

    before, after = hashes(GatewayDefaults()), hashes(GatewayDefaults(thinking_mode="Disabled"))
    assert before["demo-engine"] == after["demo-engine"]
    assert before["demo-gateway"] != after["demo-gateway"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--gateway-thinking-mode", "disabled"],  # the CRD's spelling, as in spec.gateway.thinkingMode
        ["--gateway-max-request-bytes", "0"],
        ["--gateway-rate-limit-rps", "-1"],
        ["--gateway-rate-limit-tpm", "1.5"],
    ],
)
def test_the_operator_refuses_a_bad_gateway_default(flags):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["operator", *flags])
    assert exit_info.value.code == 2
