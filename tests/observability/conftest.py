"""A real engine and real gateways as processes on loopback, exporting traces to a loopback OTLP collector,
logging at DEBUG (the engine as JSON lines, the gateways as text), started once for this folder."""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from m3stack.local.processes import ChildProcess, ProcessGroup, free_port
from tests.helpers.otlp_collector import OtlpCollector
from tests.helpers.serving import TEST_HEALTH_ARGS

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 300.0
API_KEY = "sk-observability-test-key"


@dataclass
class Process:
    child: ChildProcess
    url: str  # the engine's metrics port, a gateway's API

    def log_lines(self) -> list[str]:
        return self.child.log_path.read_text(errors="replace").splitlines()

    def json_lines(self) -> list[dict]:
        """The log lines that are JSON objects (the access log; every line of a --log-format json process)."""
        entries = []
        for line in self.log_lines():
            if line.startswith("{"):
                entries.append(json.loads(line))
        return entries


@dataclass
class ObservedStack:
    collector: OtlpCollector
    engine: Process
    gateway: Process  # the engines' shared GenerateStream (the default), API keys on
    request_gateway: Process  # a Generate call per request: metadata as gRPC call metadata; no API keys
    model_name: str

    def client(self, gateway: Process | None = None) -> openai.OpenAI:
        base = (gateway or self.gateway).url
        return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def observed_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStack]:
    with OtlpCollector() as collector:
        group = ProcessGroup(tmp_path_factory.mktemp("observability-logs"))
        env = {**collector.environment(), "M3STACK_LOG_LEVEL": "DEBUG", "OMP_NUM_THREADS": "1"}
        try:
            grpc_port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
            engine_child = group.start(
                "engine",
                ["--log-format", "json", "engine", "--model", str(tiny_model_dir), "--device", "cpu",
                 "--host", LOOPBACK, "--port", str(grpc_port), "--metrics-port", str(metrics_port),
                 "--max-model-len", "256", "--kv-cache-gb", "0.05", "--drain-timeout", "1"],
                env=env,
            )  # fmt: skip
            engine = Process(engine_child, f"http://{LOOPBACK}:{metrics_port}")
            group.wait_http_ok(engine_child, f"{engine.url}/loaded", READY_TIMEOUT_S)
            keys = tmp_path_factory.mktemp("observability-keys") / "api-keys"
            keys.write_text(f"{API_KEY}\n")
            gateways = []
            for name, mode, auth in (
                ("gateway", "shared", ["--api-key-file", str(keys)]),
                ("gateway-request", "request", []),
            ):
                port = free_port(LOOPBACK)
                child = group.start(
                    name,
                    ["gateway", "--model", str(tiny_model_dir), "--host", LOOPBACK, "--port", str(port),
                     "--engines", f"{LOOPBACK}:{grpc_port}", "--engine-stream", mode, "--media-workers", "0",
                     *TEST_HEALTH_ARGS, *auth],
                    env=env,
                )  # fmt: skip
                gateways.append(Process(child, f"http://{LOOPBACK}:{port}"))
            for gateway in gateways:
                group.wait_http_ok(gateway.child, f"{gateway.url}/ready", READY_TIMEOUT_S)
            yield ObservedStack(collector, engine, gateways[0], gateways[1], tiny_model_dir.name)
        finally:
            group.stop_all(timeout_s=20)
