"""One engine as the gateway sees it: a gRPC channel, what health probes last said, open calls.

Each engine pod gets its own channel (a Service VIP would pin every HTTP/2 stream to one pod).
Readiness comes from the standard ``grpc.health.v1`` check plus ``GetLoads`` (``draining``);
``GetModelInfo`` is read whenever the engine (re)appears.  An engine that stops answering probes
has its open calls cancelled, so no stream waits on a dead peer.  A probe that fails while the
engine's streams still deliver responses does not count: the engine is busy (a starved CPU, a long
step holding the GIL), not gone, and cancelling its streams would lose the requests on it.
"""

import asyncio
import enum
import logging
import math
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from m3stack.gateway.engine_client import wire
from m3stack.gateway.engine_client.breaker import BreakerSettings, CircuitBreaker
from m3stack.gateway.engine_client.requests import EngineRequest
from m3stack.gateway.engine_client.shared_stream import MultiplexedCall, SharedStream
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.proto import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20  # multimodal items travel inline up to this size
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # The gateway retries itself, and only before a request's first token.
    ("grpc.enable_retries", 0),
    # While an engine is away (loading its model, restarting) the channel reconnects on a growing backoff, by default
    # up to 120 s: an engine back after minutes would wait that long for the channel, its probes (every second, see
    # pool.UNANSWERED_PROBE_PERIOD_S) failing at once meanwhile.  A refused connection a second is cheap.
    ("grpc.max_reconnect_backoff_ms", 1000),
)
ABORT_TIMEOUT_S = 2.0
# A request's engine call: its own Generate stream, or its view of the engine's shared GenerateStream.
GenerateCall = grpc.aio.UnaryStreamCall | MultiplexedCall


class EngineStatus(enum.Enum):
    CONNECTING = "connecting"  # never answered yet
    READY = "ready"
    NOT_SERVING = "not_serving"  # answers, but its health service says not serving, or it drains
    DOWN = "down"  # stopped answering probes


@dataclass(frozen=True)
class ProbeSettings:
    interval_s: float = 1.0
    timeout_s: float = 2.0
    failures_to_down: int = 2


class EngineClient:
    def __init__(
        self,
        address: str,
        breaker: BreakerSettings,
        probe: ProbeSettings,
        metrics: GatewayMetrics,
        shared_stream: bool = False,
    ) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.breaker = CircuitBreaker(breaker)
        self.status = EngineStatus.CONNECTING
        self.info: engine_pb2.ModelInfo | None = None
        self.loads: engine_pb2.Loads | None = None
        self.inflight = 0
        self.down_reason = ""
        self.probed_at = -math.inf  # event loop time of the last probe's start
        self.heard_at = -math.inf  # event loop time of the last response any stream read from it
        self._probe = probe
        self._probe_failures = 0
        self._calls: set[GenerateCall] = set()
        self._use_shared_stream = shared_stream
        self._shared: SharedStream | None = None  # opened by the first request, again after it failed
        self._metrics = metrics
        self._inflight_gauge = metrics.engine_inflight.labels(engine=address)
        self._ready_gauge = metrics.engine_ready.labels(engine=address)
        self._breaker_gauge = metrics.engine_breaker_state.labels(engine=address)
        self._ready_gauge.set(0)
        self._breaker_gauge.set(0)
        self._inflight_gauge.set(0)

    # -------------------------------------------------------------------------------------------
    # Routing view

    def routable(self) -> bool:
        return self.status is EngineStatus.READY and self.breaker.allows_request()

    def answers_probes(self) -> bool:
        """Whether its last probes got answers: it may serve (READY) or drains (NOT_SERVING)."""
        return self.status in (EngineStatus.READY, EngineStatus.NOT_SERVING)

    @property
    def waiting(self) -> int:
        """Requests queued on the engine from every gateway, as of the last probe."""
        return self.loads.num_waiting if self.loads is not None else 0

    @property
    def kv_block_size(self) -> int:
        return self.info.kv_block_size if self.info is not None else 0

    # -------------------------------------------------------------------------------------------
    # Calls

    def start_generate(self, request: EngineRequest) -> GenerateCall:
        """Start the request; its call's ``read()`` gives engine.proto responses, for ``wire.read_response``."""
        message = wire.generate_request(request)
        if self._use_shared_stream:
            if self._shared is None or self._shared.closed:
                self._shared = SharedStream(self.stub, self.address)
            call: GenerateCall = self._shared.start(message)
        else:  # a call of its own: the request's id and trace context go as gRPC metadata too
            call = self.stub.Generate(message, metadata=tuple(request.metadata.items()))
        self._calls.add(call)
        self.inflight += 1
        self._inflight_gauge.inc()
        self.breaker.on_request_start()
        return call

    def end_generate(self, call: GenerateCall) -> None:
        if call in self._calls:
            self._calls.discard(call)
            self.inflight -= 1
            self._inflight_gauge.dec()

    def note_response(self) -> None:
        """A stream read a response from the engine: it is alive, whatever a slow probe says."""
        self.heard_at = asyncio.get_running_loop().time()

    def record_success(self) -> None:
        self.breaker.on_success()
        self._breaker_gauge.set(self.breaker.state)

    def record_failure(self) -> None:
        self.breaker.on_failure()
        self._breaker_gauge.set(self.breaker.state)

    def record_abandoned(self) -> None:
        self.breaker.on_abandoned()

    async def abort(self, request_id: str, reason: str) -> None:
        """Best effort: cancelling the call already aborts; this also reaches a request still queued."""
        try:
            await self.stub.Abort(
                engine_pb2.AbortRequest(request_id=request_id, reason=reason), timeout=ABORT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            logger.debug("abort of %s on %s failed: %s", request_id, self.address, exc.code())

    # -------------------------------------------------------------------------------------------
    # Health

    async def probe(self) -> None:
        """One health round: grpc.health.v1, then ModelInfo (when unknown) and Loads."""
        self.probed_at = asyncio.get_running_loop().time()
        timeout = self._probe.timeout_s
        try:
            health = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            if serving and self.info is None:
                self.info = await self.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=timeout)
                logger.info(
                    "engine %s: model %s, context %d tokens, %s on %s",
                    self.address,
                    self.info.served_model_name,
                    self.info.max_context_length,
                    self.info.dtype,
                    self.info.device,
                )
            self.loads = await self.stub.GetLoads(engine_pb2.GetLoadsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if self.heard_at >= self.probed_at:
                logger.debug("engine %s: probe failed (%s) while its streams deliver", self.address, exc.code().name)
                return
            self._on_probe_failure(f"{exc.code().name}: {exc.details()}")
            return
        self._probe_failures = 0
        ready = serving and not self.loads.draining
        self._set_status(EngineStatus.READY if ready else EngineStatus.NOT_SERVING, "draining or not serving")

    def _on_probe_failure(self, reason: str) -> None:
        self._probe_failures += 1
        if self._probe_failures >= self._probe.failures_to_down and self.status is not EngineStatus.DOWN:
            self.down_reason = f"engine {self.address} stopped answering health checks ({reason})"
            self._set_status(EngineStatus.DOWN, reason)
            self.info = None  # it may come back as a different process
            for call in list(self._calls):
                call.cancel()
            self._close_shared_stream()

    def _set_status(self, status: EngineStatus, reason: str) -> None:
        if status is not self.status:
            if status is EngineStatus.READY:
                logger.info("engine %s is ready", self.address)
            elif self.status is not EngineStatus.CONNECTING or status is EngineStatus.DOWN:
                logger.warning("engine %s is %s: %s", self.address, status.value, reason)
            self.status = status
        self._ready_gauge.set(1 if status is EngineStatus.READY else 0)
        self._breaker_gauge.set(self.breaker.state)

    def _close_shared_stream(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    async def close(self, grace_s: float | None = None) -> None:
        if grace_s:  # let the open requests finish first, as the channel's grace does for per-request calls
            deadline = asyncio.get_running_loop().time() + grace_s
            while self._calls and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        self._close_shared_stream()
        await self.channel.close(grace=grace_s)
        self._metrics.forget_engine(self.address)


def current_task_is_cancelling() -> bool:
    """Inside ``except asyncio.CancelledError``: whether our task is being cancelled (rather than a gRPC
    call we read from, which raises the same error)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
