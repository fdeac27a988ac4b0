"""The local stack: N engines and one gateway on loopback, started in order and stopped in reverse."""

import datetime
import logging
import os
from pathlib import Path

from m3stack.local.processes import ProcessGroup, free_port

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def default_log_dir() -> Path:
    cache = Path(os.environ.get("M3STACK_CACHE", Path.home() / ".cache" / "m3stack"))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cache / "runs" / f"{stamp}-{os.getpid()}"


class LocalStack:
    def __init__(
        self,
        model_dir: Path,
        host: str,
        port: int,
        num_engines: int,
        device: str,
        log_dir: Path | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.host = host
        self.port = port
        self.num_engines = num_engines
        self.device = device
        self.processes = ProcessGroup(log_dir or default_log_dir())
        self.engine_addresses: list[str] = []
        self.served_model_name = served_model_name(model_dir)

    @property
    def base_url(self) -> str:
        shown = LOOPBACK if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{shown}:{self.port}"

    def start(self, engine_timeout_s: float, gateway_timeout_s: float) -> None:
        engines = []
        for index in range(self.num_engines):
            grpc_port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
            child = self.processes.start(
                f"engine-{index}",
                [
                    "engine",
                    "--model",
                    str(self.model_dir),
                    "--served-model-name",
                    self.served_model_name,
                    "--device",
                    self.device,
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(grpc_port),
                    "--metrics-port",
                    str(metrics_port),
                ],
            )
            engines.append((child, metrics_port))
            self.engine_addresses.append(f"{LOOPBACK}:{grpc_port}")
        # Engines load in parallel; wait for all of them.
        for child, metrics_port in engines:
            self.processes.wait_http_ok(child, f"http://{LOOPBACK}:{metrics_port}/loaded", engine_timeout_s)
            logger.info("%s ready", child.name)
        gateway = self.processes.start(
            "gateway",
            [
                "gateway",
                "--model",
                str(self.model_dir),
                "--served-model-name",
                self.served_model_name,
                "--engines",
                ",".join(self.engine_addresses),
                "--host",
                self.host,
                "--port",
                str(self.port),
            ],
        )
        self.processes.wait_http_ok(gateway, f"http://{LOOPBACK}:{self.port}/ready", gateway_timeout_s)
        logger.info("gateway ready at %s", self.base_url)

    def stop(self) -> None:
        self.processes.stop_all()


def served_model_name(model_dir: Path) -> str:
    """The name clients pass as ``model``: the checkpoint folder's name."""
    return model_dir.name
