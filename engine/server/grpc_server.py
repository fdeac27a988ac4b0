"""The ``m3stack.engine.v1.Engine`` gRPC service (grpc.aio) plus the standard ``grpc.health.v1`` service.

Every failure travels as a status code (engine.proto): bad input -> INVALID_ARGUMENT before the
request reaches the scheduler; a full waiting queue -> RESOURCE_EXHAUSTED; draining or a dead
engine loop -> UNAVAILABLE; a live duplicate id -> ALREADY_EXISTS.  Cancelling a Generate call
(client gone, deadline passed) aborts the request, which frees its KV blocks before the next step.
``GenerateStream`` (engine.server.multiplex) carries the same codes in-band, per request.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from m3stack import __version__
from m3stack.engine.runtime.errors import EngineError, ErrorCode
from m3stack.engine.runtime.request import Request
from m3stack.engine.runtime.validation import build_request
from m3stack.engine.server.async_engine import AsyncEngine
from m3stack.engine.server.convert import mm_items_from_proto, responses_from_outputs, sampling_from_proto
from m3stack.engine.server.multiplex import MultiplexedStream
from m3stack.engine.server.request_log import log_admitted
from m3stack.logs import set_request_id
from m3stack.proto import engine_pb2 as pb
from m3stack.proto import engine_pb2_grpc
from m3stack.tracing import TRACE_HEADERS

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}
DEFAULT_HEALTH_TIMEOUT_S = 20.0
REQUEST_ID_KEY = "x-request-id"
# What a request's metadata may carry into the engine (anything else, such as grpc-* keys, stays out).
REQUEST_METADATA_KEYS = (REQUEST_ID_KEY, *TRACE_HEADERS)
Context = grpc.aio.ServicerContext


@dataclass(frozen=True)
class GrpcSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 256 * 2**20  # a Generate request with inline pixels must fit
    max_tensor_bytes: int = 1 << 30  # one multimodal tensor (shared memory allows more than a message)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine, settings: GrpcSettings) -> None:
        self.engine = engine
        self.info = engine.info
        self.settings = settings

    def _build(self, request: pb.GenerateRequest, call_metadata: Mapping[str, str] | None = None) -> Request:
        engine_request = build_request(
            self.info,
            request.request_id,
            request.input_ids,
            sampling_from_proto(request.sampling),
            mm_items=mm_items_from_proto(request.mm_items, self.settings.max_tensor_bytes),
            cache_salt=request.cache_salt,
            priority=request.priority,
        )
        engine_request.metadata = request_metadata(request, call_metadata)
        log_admitted(engine_request)
        if engine_request.sampling.grammar is not None:  # compiles on a worker thread; submit() waits for it
            engine_request.grammar = self.engine.core.grammar_compiler().submit(engine_request.sampling.grammar)
        return engine_request

    # Method names are the service's RPC names, hence N802.
    async def Generate(self, request: pb.GenerateRequest, context: Context):  # noqa: N802
        call_metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        # This call's task serves this one request: its log lines carry the request's id until it ends.
        set_request_id(call_metadata.get(REQUEST_ID_KEY) or request.metadata.get(REQUEST_ID_KEY))
        try:
            engine_request = self._build(request, call_metadata)
            async for outputs in self.engine.generate(engine_request):
                for response in responses_from_outputs(request.request_id, outputs):
                    yield response
        except EngineError as exc:
            await context.abort(_STATUS[exc.code], exc.message)

    async def GenerateStream(  # noqa: N802
        self, inputs: AsyncIterator[pb.GenerateStreamRequest], context: Context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        stream = MultiplexedStream(self.engine, self._build, lambda exc: _STATUS[exc.code])
        reader = asyncio.create_task(stream.read_inputs(inputs))
        try:
            async for message in stream.responses():
                yield message
        finally:
            reader.cancel()
            stream.close()

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:  # noqa: N802
        found = self.engine.abort(request.request_id, request.reason or "aborted by the caller")
        return pb.AbortResponse(found=found)

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Context) -> pb.HealthCheckResponse:  # noqa: N802
        remaining = context.time_remaining()
        timeout = DEFAULT_HEALTH_TIMEOUT_S if remaining is None else max(0.0, remaining - 0.05)
        healthy, message, latency_ms = await self.engine.health_check(timeout)
        return pb.HealthCheckResponse(healthy=healthy, message=message, latency_ms=latency_ms)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.ModelInfo:  # noqa: N802
        info = self.info
        return pb.ModelInfo(
            model_path=info.model_path,
            served_model_name=info.served_model_name,
            model_type=info.model_type,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            supports_vision=info.supports_vision,
            kv_block_size=info.block_size,
            image_token_id=info.image_token_id,
            video_token_id=info.video_token_id,
            dtype=info.dtype,
            device=info.device,
            engine_version=__version__,
            tensor_parallel_size=1,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.Loads:  # noqa: N802
        stats = self.engine.stats
        config = self.engine.core.scheduler.config
        return pb.Loads(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            host_kv_usage=0.0,
            num_used_tokens=stats.num_used_tokens,
            prefix_hit_rate=stats.prefix_hit_rate,
            draining=self.engine.draining,
            max_num_running=config.max_num_seqs,
            max_num_waiting=config.max_waiting,
        )


def request_metadata(request: pb.GenerateRequest, call_metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The request's id and trace context: from its ``metadata`` field, or the call's gRPC metadata (``Generate``)."""
    merged = {**request.metadata, **(call_metadata or {})}
    return {key: merged[key] for key in REQUEST_METADATA_KEYS if merged.get(key)}


class GrpcServer:
    """The gRPC server with both services; ``drain`` flips health to NOT_SERVING before draining the engine."""

    def __init__(self, engine: AsyncEngine, settings: GrpcSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.health = HealthServicer()
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ]
        )
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine, settings), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    async def start(self) -> int:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.port = self.server.add_insecure_port(f"{host}:{self.settings.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.settings.host}:{self.settings.port}")
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, finish what runs within ``timeout_s``, abort the rest; returns the aborted count."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        aborted = await self.engine.drain(timeout_s)
        if aborted:
            logger.warning("drain deadline reached: aborted %d requests", aborted)
        return aborted

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
