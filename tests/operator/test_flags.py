"""What the pods are told must be what the processes understand: the rendered command lines and
ConfigMap variables go through the real `m3stack` parser (engine/cli.py, gateway/cli.py)."""

import argparse

import pytest

from m3stack.cli import build_parser
from m3stack.operator.render import render_children
from m3stack.options import env_name

SPEC = {
    "model": {"name": "m3-prod", "path": "/weights/m3", "pvc": {"claimName": "weights", "mountPath": "/weights"}},
    "engine": {
        "grpcPort": 6001,
        "metricsPort": 9401,
        "accelerator": {"count": 2},
        "drain": {"shutdownTimeoutSeconds": 123},
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


def _rendered(make_m3d, images, component: str) -> tuple[list[str], dict[str, str]]:
    children = {(child["kind"], child["metadata"]["name"]): child for child in render_children(make_m3d(SPEC), images)}
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
