"""The local stack: N engines and one gateway on loopback, started in order and stopped in reverse."""

import datetime
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from m3stack.local.processes import ChildProcess, ProcessGroup, free_port, port_is_free

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
KEEP_RUN_LOGS = 20  # newest run folders kept under the cache; older ones are removed at the next start


@dataclass
class EngineProcess:
    """One engine child and where it listens (fixed for its restarts: the gateway has its address)."""

    child: ChildProcess
    address: str  # gRPC HOST:PORT
    probe_url: str  # http://HOST:PORT of /metrics, /loaded, /ready, /health


class LocalStack:
    def __init__(
        self,
        model_dir: Path,
        host: str,
        port: int,
        num_engines: int,
        device: str,
        log_dir: Path | None = None,
        engine_args: Sequence[str] = (),
        gateway_args: Sequence[str] = (),
        engine_envs: Sequence[dict[str, str]] | None = None,
    ) -> None:
        """``engine_args``/``gateway_args`` are extra flags for every engine / the gateway;
        ``engine_envs[i]`` extra environment variables of engine i (e.g. the GPU it sees)."""
        if engine_envs is not None and len(engine_envs) != num_engines:
            raise ValueError(f"{len(engine_envs)} engine environments for {num_engines} engines")
        self.model_dir = model_dir
        self.host = host
        self.port = port
        self.num_engines = num_engines
        self.device = device
        self.engine_args = list(engine_args)
        self.gateway_args = list(gateway_args)
        self.engine_envs = list(engine_envs) if engine_envs is not None else [{} for _ in range(num_engines)]
        self.processes = ProcessGroup(log_dir or new_run_log_dir())
        self.engines: list[EngineProcess] = []
        self.gateway: ChildProcess | None = None
        self.served_model_name = served_model_name(model_dir)

    @property
    def base_url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def log_dir(self) -> Path:
        return self.processes.log_dir

    def start(self, engine_timeout_s: float, gateway_timeout_s: float) -> None:
        """Start the engines (in parallel) and then the gateway; return once the gateway is ready."""
        if not port_is_free(self.host, self.port):
            raise OSError(f"{self.host}:{self.port} is in use: stop what listens there or pass another --port")
        for index in range(self.num_engines):
            self.engines.append(self._start_engine(index))
        for engine in self.engines:
            self.processes.wait_http_ok(engine.child, f"{engine.probe_url}/loaded", engine_timeout_s)
            logger.info("%s ready", engine.child.name)
        self.gateway = self.processes.start(
            "gateway",
            [
                "gateway",
                "--model",
                str(self.model_dir),
                "--served-model-name",
                self.served_model_name,
                "--engines",
                ",".join(engine.address for engine in self.engines),
                "--host",
                self.host,
                "--port",
                str(self.port),
                *self.gateway_args,
            ],
        )
        self.processes.wait_http_ok(self.gateway, f"{self.base_url}/ready", gateway_timeout_s)
        logger.info("gateway ready at %s", self.base_url)

    def _start_engine(self, index: int) -> EngineProcess:
        grpc_port, probe_port = free_port(LOOPBACK), free_port(LOOPBACK)
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
                str(probe_port),
                *self.engine_args,
            ],
            env=self.engine_envs[index],
        )
        return EngineProcess(child, f"{LOOPBACK}:{grpc_port}", f"http://{LOOPBACK}:{probe_port}")

    def restart_engine(self, index: int, timeout_s: float) -> EngineProcess:
        """Start engine ``index`` again on its old ports once it has exited; return when it is loaded.

        The gateway keeps probing the address and routes to the engine again once it answers."""
        engine = self.engines[index]
        engine.child = self.processes.restart(engine.child)
        self.processes.wait_http_ok(engine.child, f"{engine.probe_url}/loaded", timeout_s)
        logger.info("%s ready again", engine.child.name)
        return engine

    def first_exited(self) -> ChildProcess | None:
        return self.processes.first_exited()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Gateway first (it stops accepting and lets open streams finish), then the engines together."""
        if self.gateway is not None:
            self.processes.stop([self.gateway], timeout_s)
        self.processes.stop([engine.child for engine in self.engines], timeout_s)
        self.processes.stop_all(timeout_s)  # anything else started through self.processes

    def kill(self) -> None:
        self.processes.kill_all()


def http_url(listen_host: str, port: int) -> str:
    """Where a client on this machine reaches a server listening on ``listen_host:port``."""
    host = {"0.0.0.0": LOOPBACK, "": LOOPBACK, "::": "::1"}.get(listen_host, listen_host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def served_model_name(model_dir: Path) -> str:
    """The name clients pass as ``model``: the checkpoint folder's name."""
    return model_dir.name


def new_run_log_dir() -> Path:
    """``$M3STACK_CACHE/runs/<time>-<pid>``; the oldest run folders beyond the newest KEEP_RUN_LOGS go."""
    runs = Path(os.environ.get("M3STACK_CACHE", Path.home() / ".cache" / "m3stack")) / "runs"
    if runs.is_dir():
        for old in sorted(runs.iterdir(), reverse=True)[KEEP_RUN_LOGS - 1 :]:  # names start with the time
            shutil.rmtree(old, ignore_errors=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return runs / f"{stamp}-{os.getpid()}"
