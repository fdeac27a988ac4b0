"""A real engine server on loopback, on the tiny model, driven from the tests through real gRPC and HTTP clients."""

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc
import pytest

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.server.async_engine import AsyncEngine
from m3stack.engine.server.grpc_server import GrpcServer, GrpcSettings
from m3stack.engine.server.http import ServingState, SidePortServer
from m3stack.engine.server.metrics import EngineMetrics
from m3stack.proto import engine_pb2_grpc

LOOPBACK = "127.0.0.1"


class ServerThread:
    """gRPC server + metrics port + engine thread, on an event loop of their own."""

    def __init__(self, core: EngineCore, max_tensor_bytes: int = 1 << 30) -> None:
        self.core = core
        self.settings = GrpcSettings(host=LOOPBACK, port=0, max_tensor_bytes=max_tensor_bytes)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.metrics = EngineMetrics(core.info.served_model_name, core.info.max_model_len)
        self.engine = AsyncEngine(core, self.metrics)
        self.server: GrpcServer | None = None  # grpc.aio objects must be created on their event loop
        self.side_port = SidePortServer(ServingState(self.engine), self.metrics.registry, LOOPBACK, 0)
        self.port = self.run(self._start())
        self.channel = grpc.insecure_channel(f"{LOOPBACK}:{self.port}")
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    async def _start(self) -> int:
        self.engine.start()
        await self.side_port.start()
        self.server = GrpcServer(self.engine, self.settings)
        return await self.server.start()

    @property
    def metrics_url(self) -> str:
        site_port = self.side_port._runner.addresses[0][1]
        return f"http://{LOOPBACK}:{site_port}"

    def run(self, coroutine, timeout: float = 60.0):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def on_engine(self, function: Callable[[EngineCore], object]):
        """``function(core)`` on the engine thread between steps."""
        return self.run(self.engine.run_on_engine_thread(function))

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is running or waiting, then check the pool and queue invariants."""
        future: Future = asyncio.run_coroutine_threadsafe(self._wait_idle(), self.loop)
        future.result(timeout)
        self.on_engine(lambda core: core.scheduler.check_invariants())

    async def _wait_idle(self) -> None:
        while True:
            idle = await self.engine.run_on_engine_thread(lambda core: not core.has_work)
            if idle and not self.engine.num_live_requests:
                return
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self.channel.close()
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _stop(self) -> None:
        await self.server.stop(0)
        await self.engine.stop()
        await self.side_port.stop()


@pytest.fixture(scope="module")
def make_server(tiny_model_dir) -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def make(max_tensor_bytes: int = 1 << 30, **config) -> ServerThread:
        settings = {"model": str(tiny_model_dir), "num_kv_blocks": 512, "max_num_batched_tokens": 256, **config}
        server = ServerThread(build_engine_core(EngineConfig(**settings)), max_tensor_bytes)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def server(make_server) -> ServerThread:
    # Async scheduling (one step in flight), as on GPUs, so the streaming/abort paths run against it too.
    return make_server(max_num_seqs=40, max_model_len=512, async_scheduling=True)
