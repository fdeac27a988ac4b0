"""One engine process from start to exit: probes up, model loaded, gRPC serving, drain on SIGTERM, stop."""

import asyncio
import logging
import signal
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, disable_created_metrics

from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.server.async_engine import AsyncEngine
from m3stack.engine.server.grpc_server import GrpcServer, GrpcSettings
from m3stack.engine.server.http import ServingState, SidePortServer
from m3stack.engine.server.metrics import EngineMetrics
from m3stack.engine.server.request_log import log_finished
from m3stack.engine.server.tracing import RequestSpans
from m3stack.tracing import tracer_from_environment

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
    from m3stack.engine.assembly.build import build_engine_core  # torch: load it only when serving

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests drive serve() directly)
            break

    try:
        tracer = tracer_from_environment("m3stack-engine")
    except ValueError as exc:
        logger.error("tracing: %s", exc)
        return 2
    # As vLLM's server: no `<counter>_created` series (a timestamp per counter and histogram that no dashboard
    # reads, doubling the series a scrape returns).
    disable_created_metrics()
    registry = CollectorRegistry()  # served before the model loads; the metrics join it once it has
    state = ServingState()
    side_port = SidePortServer(state, registry, settings.metrics_host, settings.metrics_port)
    await side_port.start()
    try:
        try:
            core = await asyncio.to_thread(build_engine_core, settings.engine)
        except (OSError, ValueError) as exc:
            logger.error("cannot start the engine: %s", exc)
            return 1
        metrics = EngineMetrics(core.info.served_model_name, core.info.max_model_len, registry)
        metrics.on_finished.append(log_finished)
        if tracer is not None:
            metrics.on_finished.append(RequestSpans(tracer))
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
