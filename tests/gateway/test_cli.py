"""``m3stack gateway``: configuration errors exit with code 2 and say what to fix."""

import argparse
import logging
import subprocess
import sys

import pytest

from m3stack.gateway import cli
from m3stack.options import OptionGroup


def parse(args: list[str]):
    parser = argparse.ArgumentParser(prog="m3stack gateway")
    cli.add_arguments(OptionGroup(parser, "gateway"))
    return parser.parse_args(args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engines", "127.0.0.1:1"], "--model is required"),
        (["--model", "/nonexistent/folder", "--engines", "127.0.0.1:1"], "not a folder"),
        (["--model", "{model}"], "exactly one of --engines and --engine-service"),
        (["--model", "{model}", "--engines", "127.0.0.1:1", "--engine-service", "engines:1"], "exactly one"),
        (["--model", "{empty}", "--engines", "127.0.0.1:1"], "no tokenizer.json"),
    ],
)
def test_configuration_errors_return_2(tiny_model_dir, tmp_path, caplog, args, message):
    filled = [a.format(model=tiny_model_dir, empty=tmp_path) for a in args]
    with caplog.at_level(logging.ERROR):
        assert cli.run(parse(filled)) == 2
    assert message in caplog.text


def test_the_command_exits_2_with_the_message(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "m3stack", "gateway", "--model", str(tiny_model_dir), "--engines", "no-port"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr
