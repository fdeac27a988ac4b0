"""The set of engines the gateway routes to, kept current by discovery and health probes."""

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from m3stack.gateway.engine_client.breaker import BreakerSettings
from m3stack.gateway.engine_client.client import EngineClient, EngineStatus, ProbeSettings
from m3stack.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

# An engine removed by discovery keeps its channel this long for the streams still open on it.
RETIRE_GRACE_S = 600.0
# An engine that does not answer probes (still loading, just discovered, too slow for its first probe on a busy
# machine, or restarting) gets no traffic until a probe finds it ready.  Waiting a whole --health-interval for
# that probe (users set 30-60 s to keep the probe load on serving engines low) would leave it idle that long,
# so it is probed this often instead; probing an address where nothing answers costs the engines nothing.
UNANSWERED_PROBE_PERIOD_S = 1.0


class EnginePool:
    def __init__(
        self, breaker: BreakerSettings, probe: ProbeSettings, metrics: GatewayMetrics, shared_stream: bool = False
    ) -> None:
        self._breaker = breaker
        self._shared_stream = shared_stream
        self._probe = probe
        self._unanswered_period_s = min(UNANSWERED_PROBE_PERIOD_S, probe.interval_s)  # never above the interval
        self._metrics = metrics
        self.engines: dict[str, EngineClient] = {}
        self._retiring: dict[EngineClient, float] = {}  # engine -> loop time it was removed
        self._task: asyncio.Task[None] | None = None

    # -------------------------------------------------------------------------------------------
    # Membership

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Make the pool hold exactly these engines (``HOST:PORT``), keeping existing channels."""
        wanted = list(dict.fromkeys(addresses))
        for address in wanted:
            if address in self.engines:
                continue
            revived = next((engine for engine in self._retiring if engine.address == address), None)
            if revived is not None:
                del self._retiring[revived]
                self.engines[address] = revived
            else:
                self.engines[address] = EngineClient(
                    address, self._breaker, self._probe, self._metrics, self._shared_stream
                )
            logger.info("engine %s added", address)
        for address in [a for a in self.engines if a not in wanted]:
            engine = self.engines.pop(address)
            logger.info("engine %s removed (%d requests still open on it)", address, engine.inflight)
            self._retiring[engine] = asyncio.get_running_loop().time()

    # -------------------------------------------------------------------------------------------
    # What routing and the API ask

    def routable(self) -> list[EngineClient]:
        return [engine for engine in self.engines.values() if engine.routable()]

    def any_ready(self) -> bool:
        return any(engine.status is EngineStatus.READY for engine in self.engines.values())

    def context_length(self) -> int | None:
        """The smallest context among ready engines: a prompt that fits it fits wherever it goes."""
        lengths = [
            engine.info.max_context_length
            for engine in self.engines.values()
            if engine.status is EngineStatus.READY and engine.info is not None
        ]
        return min(lengths) if lengths else None

    def queue_capacity(self) -> int | None:
        """How many requests the routable engines' waiting queues hold in all (None: not known yet): a request
        that starts more could never be queued, however long it waited."""
        sizes = [engine.loads.max_num_waiting for engine in self.routable() if engine.loads is not None]
        return sum(sizes) if sizes and all(sizes) else None

    def seconds_until_retry(self) -> float:
        """A Retry-After hint: when the first open breaker lets a probe through, else the shortest probe period."""
        waits = [engine.breaker.seconds_until_retry() for engine in self.engines.values()]
        waits = [wait for wait in waits if wait > 0]
        if waits:
            return min(waits)
        return min((self._probe_period(engine) for engine in self.engines.values()), default=self._probe.interval_s)

    # -------------------------------------------------------------------------------------------
    # Background probing

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_forever(), name="engine-probes")

    def _probe_period(self, engine: EngineClient) -> float:
        """The scheduling rule: engines that answer probes every interval, the others every second at most."""
        if engine.answers_probes():
            return self._probe.interval_s
        return self._unanswered_period_s

    async def probe_all(self) -> None:
        await self._probe_round(list(self.engines.values()))

    async def _probe_round(self, engines: list[EngineClient]) -> None:
        await asyncio.gather(*(engine.probe() for engine in engines))
        await self._close_retired()

    async def _probe_forever(self) -> None:
        """Probes each engine once its period since its last probe has passed, checked every shortest period."""
        while True:
            await asyncio.sleep(self._unanswered_period_s)  # start() follows a probe_all()
            now = asyncio.get_running_loop().time()
            due = [engine for engine in self.engines.values() if now - engine.probed_at >= self._probe_period(engine)]
            try:
                await self._probe_round(due)
            except Exception:  # a bug here must not silently stop health checking
                logger.exception("engine probe round failed")

    async def _close_retired(self) -> None:
        now = asyncio.get_running_loop().time()
        done = [
            engine
            for engine, removed_at in self._retiring.items()
            if engine.inflight == 0 or now - removed_at > RETIRE_GRACE_S
        ]
        for engine in done:
            del self._retiring[engine]
        await asyncio.gather(*(engine.close(grace_s=1.0) for engine in done))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        engines = [*self.engines.values(), *self._retiring]
        self.engines.clear()
        self._retiring.clear()
        await asyncio.gather(*(engine.close(grace_s=1.0) for engine in engines))
