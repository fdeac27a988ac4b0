"""The m3stack command: subcommands, help, and flag/env validation with exit code 2."""

import subprocess
import sys

import pytest

from m3stack import options
from m3stack.cli import SUBCOMMANDS


def _m3stack(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "m3stack", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_subcommand_has_help(command):
    result = _m3stack(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"m3stack {command}" in result.stdout


def test_bad_flag_value_exits_2_with_a_clear_message():
    result = _m3stack("engine", "--port", "70000")
    assert result.returncode == 2
    assert "--port" in result.stderr and "1..65535" in result.stderr


def test_an_abbreviated_flag_is_refused():
    result = _m3stack("engine", "--max-model", "4096")
    assert result.returncode == 2
    assert "unrecognized arguments: --max-model" in result.stderr


@pytest.mark.parametrize("flag", ["--index-dtype", "--kv-cache-dtype"])
def test_a_cache_dtype_the_engine_cannot_store_exits_2_naming_the_choices(flag):
    result = _m3stack("engine", flag, "fp16")
    assert result.returncode == 2
    assert flag in result.stderr and "fp8_e4m3" in result.stderr


def test_bad_environment_value_exits_2_naming_the_variable():
    result = _m3stack("gateway", env={"M3STACK_GATEWAY_PORT": "http"})
    assert result.returncode == 2
    assert "M3STACK_GATEWAY_PORT" in result.stderr and "integer" in result.stderr


def test_environment_sets_the_default_and_the_flag_wins():
    parser = __import__("m3stack.cli", fromlist=["build_parser"]).build_parser
    import os

    os.environ["M3STACK_ENGINE_PORT"] = "6000"
    try:
        assert parser().parse_args(["engine"]).port == 6000
        assert parser().parse_args(["engine", "--port", "6001"]).port == 6001
    finally:
        del os.environ["M3STACK_ENGINE_PORT"]


@pytest.mark.parametrize(
    ("validator", "text", "expected"),
    [
        (options.port, "8080", 8080),
        (options.positive_int, "3", 3),
        (options.non_negative_float, "0", 0.0),
        (options.fraction, "0.5", 0.5),
        (options.boolean, "yes", True),
        (options.boolean, "off", False),
        (options.host_port, "[::1]:50051", ("::1", 50051)),
        (options.host_port_list, "a:1,b:2", [("a", 1), ("b", 2)]),
    ],
)
def test_validators_accept_good_values(validator, text, expected):
    assert validator(text) == expected


@pytest.mark.parametrize(
    ("validator", "text"),
    [
        (options.port, "0"),
        (options.port, "x"),
        (options.positive_int, "0"),
        (options.non_negative_float, "-1"),
        (options.non_negative_float, "nan"),
        (options.fraction, "1.5"),
        (options.boolean, "maybe"),
        (options.host_port, "nohost"),
        (options.host_port_list, ","),
    ],
)
def test_validators_reject_bad_values(validator, text):
    with pytest.raises(Exception, match=r"expected|must|got"):
        validator(text)


def test_env_name():
    assert options.env_name("engine", "--kv-offload-gb") == "M3STACK_ENGINE_KV_OFFLOAD_GB"


HEAVY_MODULES = ("av", "PIL", "torch", "numpy")


def test_building_every_parser_imports_no_heavy_library():
    # Every subcommand's parser is built at startup, the gateway's with all the media limit flags, so the
    # media pipeline's libraries must stay out until a command runs.
    code = (
        "import sys, m3stack.cli\n"
        "m3stack.cli.build_parser().parse_args(['gateway', '--media-max-images', '3'])\n"
        "print('m3stack.gateway.multimodal.limits' in sys.modules)\n"
        f"print(*sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    limits_loaded, *loaded = result.stdout.split()
    assert loaded == [], f"building the parsers imported {loaded}"
    assert limits_loaded == "True", "the gateway's media flags no longer come from multimodal/limits.py"
