"""`m3stack probe`, the chart's `helm test` hook, as a process against real gateways, and its shape checks."""

import copy
import os
import subprocess
import sys

import httpx
import pytest

from m3stack.local.processes import free_port
from m3stack.probe import chat_completion_problems
from tests.observability.conftest import API_KEY, ObservedStack

pytestmark = pytest.mark.xdist_group("observability")


def run_probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m3stack", "probe", *args],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "M3STACK_API_KEY"}, **(env or {})},
    )  # fmt: skip


def test_the_probe_passes_on_working_gateways(observed_stack: ObservedStack):
    urls = f"{observed_stack.request_gateway.url}/v1,{observed_stack.gateway.url}/v1"
    result = run_probe("--url", urls, env={"M3STACK_API_KEY": API_KEY})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("a well-formed chat completion") == 2


def test_the_probe_names_each_gateway_that_fails(observed_stack: ObservedStack):
    closed = f"http://127.0.0.1:{free_port()}/v1"
    result = run_probe("--url", f"{observed_stack.gateway.url}/v1,{closed},{observed_stack.request_gateway.url}/v1")
    assert result.returncode == 1
    assert f"{observed_stack.gateway.url}/v1" in result.stderr and "answered 401" in result.stderr  # no key given
    assert f"{closed}" in result.stderr and "ConnectError" in result.stderr
    assert result.stderr.count("a well-formed chat completion") == 1


def test_bad_arguments_exit_2():
    assert run_probe().returncode == 2
    assert run_probe("--url", "ftp://example.invalid/v1").returncode == 2


def test_the_shape_check_accepts_a_real_answer_and_flags_each_defect(observed_stack: ObservedStack):
    body = {"model": observed_stack.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answer = httpx.post(f"{observed_stack.request_gateway.url}/v1/chat/completions", json=body, timeout=120).json()
    assert chat_completion_problems(answer, observed_stack.model_name, 4) == []
    defects = {
        "object": lambda a: a.update(object="text_completion"),
        "model": lambda a: a.update(model="other"),
        "choices": lambda a: a.update(choices=[]),
        "role": lambda a: a["choices"][0]["message"].update(role="user"),
        "content": lambda a: a["choices"][0]["message"].update(content=None),
        "finish_reason": lambda a: a["choices"][0].update(finish_reason=None),
        "usage": lambda a: a["usage"].update(total_tokens=a["usage"]["total_tokens"] + 1),
        "too many tokens": lambda a: a["usage"].update(
            completion_tokens=9, total_tokens=a["usage"]["prompt_tokens"] + 9
        ),
    }
    for name, spoil in defects.items():
        spoiled = copy.deepcopy(answer)
        spoil(spoiled)
        assert chat_completion_problems(spoiled, observed_stack.model_name, 4), name
    assert chat_completion_problems("not json", observed_stack.model_name, 4)
