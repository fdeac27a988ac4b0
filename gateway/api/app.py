"""The FastAPI application: routes, error rendering, middleware, and the engines' lifecycle."""

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from m3stack import __version__
from m3stack.gateway.api.access_log import ACCESS_STATE_KEY, enable_access_log
from m3stack.gateway.api.auth import ApiKeys
from m3stack.gateway.api.config import GatewayConfig
from m3stack.gateway.api.errors import HTTP_ERROR_CODES, api_error_response, http_error_response
from m3stack.gateway.api.fast_path import CompletionFastPath
from m3stack.gateway.api.openapi_document import serve_with_vocabulary
from m3stack.gateway.api.prompts import PromptBuilder
from m3stack.gateway.api.rate_limit import ANONYMOUS_KEY, RateLimiter, charged_tokens
from m3stack.gateway.api.request_tracking import TrackedRequest
from m3stack.gateway.api.service import CompletionService
from m3stack.gateway.api.tokenize_api import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from m3stack.gateway.api.validation_errors import validation_error_body
from m3stack.gateway.engine_client.discovery import DnsDiscovery
from m3stack.gateway.engine_client.pool import EnginePool
from m3stack.gateway.errors import APIError
from m3stack.gateway.generation.dispatch import Dispatcher
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.gateway.multimodal import MediaPipeline, load_profile
from m3stack.gateway.routing.policies import make_policy
from m3stack.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from m3stack.gateway.tokenize.chat_template import ChatTemplate
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer
from m3stack.logs import request_context

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "invalid request: bad JSON, invalid parameters, prompt too long"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (429, "this API key is over a rate limit (see Retry-After)"),
        (502, "an engine failed"),
        (503, "no engine can take the request now (see Retry-After)"),
    ]
}
# With stream=true the completion routes answer server-sent events instead of JSON: each event's data
# is one chunk as JSON, then the literal [DONE].
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"}},
    "required": ["data"],
}
STREAMING_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}, "description": "JSON, or SSE when streamed"}
}
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
RATE_LIMITED_PATHS = ("/v1/chat/completions", "/v1/completions")
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, at the root; they need an API key like /v1
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayState:
    """What the routes share: built once per app from the config."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.served_model_name)
        self.tokenizer = ModelTokenizer.from_folder(config.model_dir)
        template = self.tokenizer.chat_template
        self.chat_template = ChatTemplate(template, self.tokenizer.special_tokens) if template else None
        self.executor = ThreadPoolExecutor(max_workers=config.tokenizer_threads, thread_name_prefix="tokenize")
        self.media = media_pipeline(config)
        self.pool = EnginePool(config.breaker, config.probe, self.metrics, config.engine_stream == "shared")
        self.policy = make_policy(config.routing, load_penalty=config.prefix_load_penalty)
        self.dispatcher = Dispatcher(self.pool, self.policy, self.metrics, config.max_attempts)
        self.service = CompletionService(
            config.served_model_name,
            self.tokenizer,
            PromptBuilder(self.tokenizer, self.chat_template, self.executor, self.media),
            self.pool,
            self.dispatcher,
            self.metrics,
            config.request_limits,
            thinking_mode=config.thinking_mode,
        )
        self.api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
        self.discovery: DnsDiscovery | None = None
        self.draining = False
        self.started_at = int(time.time())

    async def start(self) -> None:
        if self.media is not None:
            await self.media.start()
        if self.config.engine_service is not None:
            host, port = self.config.engine_service
            self.discovery = DnsDiscovery(host, port, self.pool, self.config.discovery_interval_s)
            await self.discovery.refresh()
            self.discovery.start()
        else:
            self.pool.set_addresses(self.config.engines)
        await self.pool.probe_all()
        self.pool.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        await self.pool.stop()
        if self.media is not None:
            await self.media.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def media_pipeline(config: GatewayConfig) -> MediaPipeline | None:
    """The image/video pipeline for the checkpoint's ``model_type``, or None (media parts are then a 400)."""
    if config.media_workers == 0:
        logger.info("image and video input is off (--media-workers 0)")
        return None
    try:
        model_type = json.loads((config.model_dir / "config.json").read_text())["model_type"]
        profile = load_profile(model_type, config.model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("image and video input is off: %s", exc)
        return None
    return MediaPipeline(profile, config.media_limits, workers=config.media_workers)


def create_app(config: GatewayConfig, tracer: trace.Tracer | None = None) -> FastAPI:
    """``tracer``: where the request spans go (None: no tracing; the CLI passes the OTEL_* variables' one)."""
    state = GatewayState(config)
    if config.access_log:
        enable_access_log()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        # FastAPI's built-in OpenTelemetry checks its providers on every request (about 4% of the CPU a
        # streamed request costs); the gateway makes its own span per request, only when tracing is on.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        title="m3stack gateway",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible API for MiniMax-M3-class models served by m3stack engines.",
    )
    app.state.gateway = state
    _install_error_handlers(app)
    _add_routes(app, state)
    serve_with_vocabulary(app, state.tokenizer.vocab_size)
    # Middleware added last runs first: RequestGuard, then the fast path, then FastAPI's routing.
    app.add_middleware(CompletionFastPath, service=state.service)
    app.add_middleware(
        RequestGuard,
        metrics=state.metrics,
        max_body_bytes=config.max_request_bytes,
        api_keys=state.api_keys,
        tracer=tracer,
        access_log=config.access_log,
        rate_limiter=RateLimiter(config.rate_limits) if config.rate_limits.enabled else None,
    )
    return app


def _add_routes(app: FastAPI, state: GatewayState) -> None:
    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERROR_RESPONSES, **STREAMING_RESPONSE},
        summary="Chat completion; with stream=true, server-sent events of chat.completion.chunk ending with [DONE]",
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await state.service.chat(body, request, request.state.arrival_s)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**ERROR_RESPONSES, **STREAMING_RESPONSE},
        summary="Text completion; with stream=true, server-sent events ending with [DONE]",
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await state.service.completions(body, request, request.state.arrival_s)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=state.config.served_model_name,
                    created=state.started_at,
                    max_model_len=state.pool.context_length(),
                )
            ]
        )

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES, summary="vLLM's /tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await state.service.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES, summary="vLLM's /detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return state.service.detokenize(body)

    @app.get("/health", summary="Liveness: the process serves HTTP")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/ready", summary="Readiness: at least one engine takes requests", responses={503: {"model": ErrorResponse}}
    )
    async def ready() -> Response:
        engines = {address: engine.status.value for address, engine in state.pool.engines.items()}
        if state.draining or not state.pool.any_ready():
            reason = "draining" if state.draining else "no engine is ready"
            return JSONResponse({"status": reason, "engines": engines}, status_code=503)
        return JSONResponse({"status": "ready", "engines": engines})

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {PROMETHEUS_CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return http_error_response(exc)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        error = APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
        return JSONResponse(error.body(), status_code=500)


class RequestGuard:
    """Pure ASGI middleware in front of every route: the arrival time, the request's id, trace span and
    access line (request_tracking.py), API keys for /v1 (the probes and /metrics stay open), the body
    size cap (413), and request metrics for /v1."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: GatewayMetrics,
        max_body_bytes: int,
        api_keys: ApiKeys | None,
        tracer: trace.Tracer | None = None,
        access_log: bool = False,
        rate_limiter: RateLimiter | None = None,
    ) -> None:
        """``rate_limiter``: per-API-key limits on the completion routes (429 with Retry-After)."""
        self._app = app
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self._api_keys = api_keys
        self._tracer = tracer
        self._access_log = access_log
        self._rate_limiter = rate_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_s"] = time.perf_counter()
        path = scope["path"]
        api_request = path.startswith("/v1/")  # probes and /metrics get no span and no access line
        try:
            tracked = TrackedRequest(scope, self._tracer if api_request else None, self._access_log)
        except APIError as exc:  # a malformed x-request-id
            await self._reject(scope, send, exc, path if path in API_PATHS else None)
            return
        with request_context(tracked.request_id), tracked.activated():
            try:
                await self._guard(scope, receive, tracked.sender(send))
            finally:
                tracked.finish(api_request)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        endpoint = path if path in API_PATHS else None
        if self._api_keys is not None and (path.startswith("/v1/") or path in TOKENIZER_PATHS):
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            try:
                scope["state"][ACCESS_STATE_KEY].api_key_id = self._api_keys.check(authorization.decode("latin-1"))
            except APIError as exc:
                await self._reject(scope, send, exc, endpoint)
                return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            too_large = APIError(
                413,
                f"The request body is larger than {self._max_body_bytes} bytes (--max-request-bytes)",
                code=HTTP_ERROR_CODES[413],
            )
            await self._reject(scope, send, too_large, endpoint)
            return
        admission = None
        if self._rate_limiter is not None and path in RATE_LIMITED_PATHS:
            try:
                admission = self._rate_limiter.admit(scope["state"][ACCESS_STATE_KEY].api_key_id or ANONYMOUS_KEY)
            except APIError as exc:
                await self._reject(scope, send, exc, endpoint)
                return
        status_seen: list[int] = []
        received = 0
        limit = self._max_body_bytes

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises HTTPException from a body read (anything else becomes a 400).
                    raise StarletteHTTPException(
                        413, f"The request body is larger than {limit} bytes (--max-request-bytes)"
                    )
            return message

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._app(scope, counted_receive, observed_send)
        finally:
            if admission is not None:
                admission.finish(charged_tokens(scope["state"][ACCESS_STATE_KEY]))
            if endpoint is not None:
                status = status_seen[0] if status_seen else 499
                self._metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    async def _reject(self, scope: Scope, send: Send, error: APIError, endpoint: str | None) -> None:
        await api_error_response(error)(scope, _no_body, send)
        if endpoint is not None:
            self._metrics.requests.labels(endpoint=endpoint, status=str(error.status)).inc()


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
