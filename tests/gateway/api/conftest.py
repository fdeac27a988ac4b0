"""Real engines and gateways as subprocesses on loopback, started once per test session.

Every test module here is in the xdist group ``gateway_api`` so that one worker runs them all and
the engines start once.  Engines use the tiny default checkpoint on CPU with a short context and a
small KV cache, so the whole folder stays fast on two cores.
"""

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from m3stack.local.processes import ChildProcess, ProcessGroup, free_port
from tests.helpers.serving import TEST_HEALTH_ARGS, Samples, poll_until, scrape

LOOPBACK = "127.0.0.1"
ENGINE_CONTEXT = 256
ENGINE_READY_TIMEOUT_S = 300.0
GATEWAY_READY_TIMEOUT_S = 120.0


@dataclass
class Engine:
    child: ChildProcess
    address: str
    metrics_url: str

    def metrics(self) -> Samples:
        return scrape(self.metrics_url)

    def kill(self) -> None:
        os.killpg(self.child.popen.pid, signal.SIGKILL)
        self.child.popen.wait(timeout=30)


@dataclass
class Gateway:
    child: ChildProcess
    base_url: str

    def client(self, api_key: str = "none", timeout_s: float = 120.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)

    def metrics(self) -> Samples:
        return scrape(f"{self.base_url}/metrics")


class Stack:
    """Starts engines and gateways for the session and stops them all at the end."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.processes = ProcessGroup(log_dir)
        self._count = 0

    def _name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}-{self._count}"

    def engine(self, *extra: str) -> Engine:
        return self.engines(1, *extra)[0]

    def engines(self, count: int, *extra: str) -> list[Engine]:
        """Start ``count`` engines at once (they load in parallel), then wait for all of them."""
        started = [self._start_engine(*extra) for _ in range(count)]
        for engine in started:
            self.processes.wait_http_ok(
                engine.child, engine.metrics_url.replace("/metrics", "/loaded"), ENGINE_READY_TIMEOUT_S
            )
        return started

    def _start_engine(self, *extra: str) -> Engine:
        port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
        child = self.processes.start(
            self._name("engine"),
            [
                "engine",
                "--model",
                str(self.model_dir),
                "--device",
                "cpu",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--max-model-len",
                str(ENGINE_CONTEXT),
                "--kv-cache-gb",
                "0.05",
                "--max-num-seqs",
                "64",
                "--drain-timeout",
                "2",
                *extra,
            ],
        )
        return Engine(child, f"{LOOPBACK}:{port}", f"http://{LOOPBACK}:{metrics_port}/metrics")

    def gateway(self, engines: list[Engine] | None, *extra: str, wait_ready: bool = True) -> Gateway:
        port = free_port(LOOPBACK)
        engine_args = ["--engines", ",".join(e.address for e in engines)] if engines is not None else []
        child = self.processes.start(
            self._name("gateway"),
            [
                "gateway",
                "--model",
                str(self.model_dir),
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                *TEST_HEALTH_ARGS,
                *engine_args,
                *extra,
            ],
        )
        gateway = Gateway(child, f"http://{LOOPBACK}:{port}")
        url = f"{gateway.base_url}/ready" if wait_ready else f"{gateway.base_url}/health"
        self.processes.wait_http_ok(child, url, GATEWAY_READY_TIMEOUT_S)
        return gateway

    def stop(self) -> None:
        self.processes.stop_all(timeout_s=20)


@pytest.fixture(scope="session")
def wait_until():
    """``wait_until(condition, timeout_s, what)``: poll until ``condition()`` is truthy, else fail."""
    return poll_until


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    running = Stack(tiny_model_dir, tmp_path_factory.mktemp("gateway-stack-logs"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def engine(stack) -> Engine:
    return stack.engine()


@pytest.fixture(scope="session")
def gateway(stack, engine) -> Gateway:
    # One media worker: enough for the image test, cheap to start.
    return stack.gateway([engine], "--media-workers", "1")


@pytest.fixture(scope="session")
def client(gateway) -> openai.OpenAI:
    return gateway.client()


@pytest.fixture(scope="session")
def model_name(tiny_model_dir) -> str:
    return tiny_model_dir.name
