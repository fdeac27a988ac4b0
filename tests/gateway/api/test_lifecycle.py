"""The gateway process: ready line, DNS discovery, and a SIGTERM that lets open streams finish."""

import os
import signal

import pytest

from tests.helpers.serving import series

pytestmark = pytest.mark.xdist_group("gateway_api")


def test_dns_discovery_finds_the_engine(stack, engine, model_name):
    port = engine.address.rsplit(":", 1)[1]
    # localhost resolves to 127.0.0.1 (where the engine listens) and maybe ::1 (nothing there).
    gateway = stack.gateway(None, "--engine-service", f"localhost:{port}", "--media-workers", "0")
    response = gateway.client().completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert response.usage.completion_tokens >= 1
    assert series(gateway.metrics(), "m3stack_gateway_engine_ready", engine=engine.address, model_name=model_name) == 1


def test_sigterm_lets_open_streams_finish(stack, engine, model_name, wait_until):
    gateway = stack.gateway([engine], "--media-workers", "0", "--drain-timeout", "60")
    assert "m3stack gateway ready on" in gateway.child.log_path.read_text()
    stream = gateway.client().completions.create(
        model=model_name, prompt="Count:", max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    received = [next(chunks) for _ in range(3)]
    os.kill(gateway.child.popen.pid, signal.SIGTERM)
    received += list(chunks)
    assert received[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in received if c.choices and c.choices[0].text) >= 1
    wait_until(lambda: gateway.child.returncode is not None, 60, "the gateway to exit")
    assert gateway.child.returncode == 0
    assert "stopping" in gateway.child.log_path.read_text()
