"""The engine's HTTP side port: Prometheus ``/metrics`` and the probes a supervisor polls.

- ``/loaded``: 200 once the model is loaded and the gRPC port serves (``m3stack up`` waits on it).
- ``/ready``: 200 while the engine admits requests (loaded, not draining, not failed): a readiness probe.
- ``/health``: 200 unless the engine loop has died: a liveness probe (draining is still alive).

It starts before the model loads, so probes get a clean 503 instead of a refused connection.
"""

import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from m3stack.engine.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass
class ServingState:
    engine: AsyncEngine | None = None  # set once the model is loaded and gRPC serves

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.engine.draining and self.engine.fatal_error is None

    @property
    def alive(self) -> bool:
        return self.engine is None or self.engine.fatal_error is None


class SidePortServer:
    def __init__(self, state: ServingState, registry: CollectorRegistry, host: str, port: int) -> None:
        self.state = state
        self.registry = registry
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.get("/metrics", self._metrics),
                web.get("/loaded", self._probe(lambda: self.state.loaded, "loaded", "loading")),
                web.get("/ready", self._probe(lambda: self.state.ready, "ready", "not ready")),
                web.get("/health", self._probe(lambda: self.state.alive, "ok", "the engine loop failed")),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("metrics and probes on http://%s:%d (/metrics /loaded /ready /health)", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    def _probe(check, good: str, bad: str):
        async def handler(_: web.Request) -> web.Response:
            return web.Response(text=good) if check() else web.Response(status=503, text=bad)

        return handler
