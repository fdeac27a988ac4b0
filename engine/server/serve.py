"""One engine process from start to exit: probes up, model loaded, gRPC serving, drain on SIGTERM, stop."""

import asyncio
import logging
import signal
from dataclasses import dataclass

from m3stack.engine.runtime.config import EngineConfig
from m3stack.engine.server.async_engine import AsyncEngine
from m3stack.engine.server.grpc_server import GrpcServer, GrpcSettings
from m3stack.engine.server.http import ServingState, SidePortServer
from m3stack.engine.server.metrics import EngineMetrics

logger = logging.getLogger(__name__)

READY_MESSAGE = "m3stack engine ready"


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineConfig
    grpc: GrpcSettings
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400
    drain_timeout_s: float = 30.0


async def serve(settings: ServeSettings, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives; returns the process exit code."""
    from m3stack.engine.runtime.builder import build_engine_core  # torch: load it only when serving

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests drive serve() directly)
            break

    metrics = EngineMetrics()
    state = ServingState()
    side_port = SidePortServer(state, metrics.registry, settings.metrics_host, settings.metrics_port)
    await side_port.start()
    try:
        try:
            core = await asyncio.to_thread(build_engine_core, settings.engine)
        except (OSError, ValueError) as exc:
            logger.error("cannot start the engine: %s", exc)
            return 1
        engine = AsyncEngine(core, metrics)
        engine.start()
        grpc_server = GrpcServer(engine, settings.grpc)
        try:
            port = await grpc_server.start()
        except OSError as exc:
            logger.error("cannot serve gRPC: %s", exc)
            await engine.stop()
            return 1
        state.engine = engine
        info = core.info
        logger.info(
            "%s: grpc %s:%d, metrics http://%s:%d, model %s (%s, %s, %s), %d KV blocks of %d tokens, context %d",
            READY_MESSAGE,
            settings.grpc.host,
            port,
            settings.metrics_host,
            settings.metrics_port,
            info.served_model_name,
            info.model_path,
            info.device,
            info.dtype,
            info.num_kv_blocks,
            info.block_size,
            info.max_model_len,
        )
        await stop.wait()
        logger.info("draining: no new requests; running ones get %.0fs", settings.drain_timeout_s)
        metrics.draining.set(1)
        await grpc_server.drain(settings.drain_timeout_s)
        await grpc_server.stop()
        await engine.stop()
        logger.info("engine stopped")
        return 0
    finally:
        await side_port.stop()
