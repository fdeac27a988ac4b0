"""Run the OpenAI-compatible HTTP gateway in front of one or more engines.

Engines come from --engines (a fixed HOST:PORT list) or --engine-service (the DNS name of the engines'
headless Service, re-resolved every --discovery-interval seconds).  The tokenizer and chat template are
read from --model.  SIGTERM stops accepting connections, marks /ready as 503 and lets open streams finish
for up to --drain-timeout seconds.
"""

import argparse
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3stack import options
from m3stack.gateway.agentic.reasoning import THINKING_MODES
from m3stack.gateway.api.request_limits import DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_SEQUENCES
from m3stack.gateway.multimodal import limits as media_limits
from m3stack.options import OptionGroup

# Idle keep-alive of client connections: uvicorn's 5 s default is shorter than what proxies and HTTP clients keep
# (nginx Ingress upstream keepalive 60 s, aiohttp 15 s), so they reuse a connection the gateway is closing and the
# request fails; 75 s outlasts them.
KEEP_ALIVE_TIMEOUT_S = 75.0
# The --model value naming the embedded tiny model (as the engine's --model does).
DEFAULT_MODEL = "default"

if TYPE_CHECKING:
    from m3stack.gateway.api.config import GatewayConfig

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add(
        "--model",
        help="model folder with tokenizer.json and the chat template (an HF-layout checkpoint), or 'default' for "
        "the embedded tiny model's files",
    )
    opts.add("--served-model-name", help="the name clients pass as `model` (default: the model folder's name)")
    opts.add("--host", default="127.0.0.1", help="HTTP listen address")
    opts.add("--port", type=options.port, default=8000, help="HTTP port")
    opts.add("--engines", type=options.host_port_list, help="comma-separated engine HOST:PORT list")
    opts.add(
        "--engine-service", type=options.host_port, help="HOST:PORT of the engines' headless Service (DNS discovery)"
    )
    opts.add("--discovery-interval", type=options.positive_float, default=5.0, help="seconds between DNS lookups")
    opts.add("--routing", default="least-inflight", choices=["least-inflight", "prefix-aware"], help="routing policy")
    opts.add(
        "--prefix-load-penalty",
        type=options.non_negative_float,
        default=0.1,
        help="prefix-aware routing: score = matched prefix ratio - penalty * excess in-flight over the least loaded"
        " engine, relative to its load",
    )
    opts.add("--api-key-file", help="file of accepted bearer tokens, one per line (re-read when it changes)")
    opts.add(
        "--max-request-bytes",
        type=options.positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body (413); larger media go by URL",
    )
    opts.add(
        "--max-request-prompts",
        type=options.positive_int,
        default=DEFAULT_MAX_PROMPTS,
        help="most prompts in one /v1/completions request (400)",
    )
    opts.add(
        "--max-request-sequences",
        type=options.positive_int,
        default=DEFAULT_MAX_SEQUENCES,
        help="most sequences (prompts x n) one request may start (400); keep it within the engines' --max-queue",
    )
    opts.add("--tokenizer-threads", type=options.positive_int, default=2, help="threads for templates and tokenizing")
    opts.add(
        "--max-attempts",
        type=options.positive_int,
        default=3,
        help="engines tried per request before its first token (retries go to other engines)",
    )
    opts.add(
        "--engine-stream",
        default="shared",
        choices=["shared", "request"],
        help="shared: all requests to an engine over one GenerateStream, the engine sending each wakeup's responses "
        "in one message; request: a Generate stream per request (one gRPC message per request per engine step)",
    )
    opts.add("--breaker-failures", type=options.positive_int, default=5, help="failures in a row that open a breaker")
    opts.add("--breaker-open", type=options.positive_float, default=10.0, help="seconds a breaker stays open")
    opts.add(
        "--health-interval",
        type=options.positive_float,
        default=1.0,
        help="seconds between probes of engines that answer (those that do not: every second)",
    )
    opts.add("--health-timeout", type=options.positive_float, default=2.0, help="deadline of one engine probe")
    opts.add(
        "--media-workers",
        type=options.non_negative_int,
        default=None,
        help="processes for image/video preprocessing (default: one per core; 0 turns media input off)",
    )
    opts.add(
        "--thinking-mode",
        default="adaptive",
        choices=list(THINKING_MODES),
        help="M3's reasoning for chat requests that do not choose (chat_template_kwargs thinking_mode or "
        "enable_thinking): adaptive lets the model decide, enabled makes it think, disabled skips it; the reasoning "
        "comes back as reasoning_content",
    )
    opts.add(
        "--rate-limit-rps",
        type=options.non_negative_float,
        default=0.0,
        help="per API key: completion requests per second, bursts of up to max(1, this); 0 = no limit (429 with "
        "Retry-After)",
    )
    opts.add(
        "--rate-limit-tpm",
        type=options.non_negative_int,
        default=0,
        help="per API key: prompt + completion tokens per minute, charged as each request ends; 0 = no limit",
    )
    opts.add(
        "--rate-limit-concurrency",
        type=options.non_negative_int,
        default=0,
        help="per API key: completion requests running at once; 0 = no limit",
    )
    media_limits.add_arguments(opts)
    opts.add("--drain-timeout", type=options.non_negative_float, default=30.0, help="seconds open streams get on stop")
    opts.add(
        "--keep-alive-timeout",
        type=options.positive_float,
        default=KEEP_ALIVE_TIMEOUT_S,
        help="seconds an idle client connection stays open; keep it above the idle timeout of the proxies and "
        "clients in front (Ingress controllers keep upstream connections 60 s), or a request sent just as the "
        "gateway closes the connection fails",
    )
    opts.flag(
        "--access-log",
        default=True,
        help="one JSON line per API request on stderr: request id, status, duration, tokens, API key id",
    )


def model_folder(model: str) -> Path:
    """The folder ``--model`` names.  'default' is the tiny model's folder in the cache, where the engine finds
    it too; the gateway reads it but cannot make it (the weights need torch): the gateway image holds its files,
    `m3stack up` and `m3stack model init-tiny` create it on a machine."""
    if model == DEFAULT_MODEL:
        from m3stack.default_model import tiny_checkpoint_dir

        folder = tiny_checkpoint_dir()
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"--model default: the tiny default model is not in {folder}; create it with "
                "`m3stack model init-tiny`, or give a model folder"
            )
        return folder
    folder = Path(model).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"--model {model}: not a folder")
    return folder


def build_config(args: argparse.Namespace) -> "GatewayConfig":
    from m3stack.gateway.api.config import GatewayConfig
    from m3stack.gateway.api.rate_limit import RateLimits
    from m3stack.gateway.api.request_limits import RequestLimits
    from m3stack.gateway.engine_client.breaker import BreakerSettings
    from m3stack.gateway.engine_client.client import ProbeSettings
    from m3stack.gateway.engine_client.discovery import format_address

    if not args.model:
        raise ValueError("--model is required: the model folder with tokenizer.json and the chat template")
    model_dir = model_folder(args.model)
    if bool(args.engines) == bool(args.engine_service):
        raise ValueError("give exactly one of --engines and --engine-service")
    return GatewayConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name or model_dir.name,
        engines=tuple(format_address(host, port) for host, port in args.engines or ()),
        engine_service=args.engine_service,
        discovery_interval_s=args.discovery_interval,
        routing=args.routing,
        prefix_load_penalty=args.prefix_load_penalty,
        api_key_file=Path(args.api_key_file) if args.api_key_file else None,
        max_request_bytes=args.max_request_bytes,
        request_limits=RequestLimits(args.max_request_prompts, args.max_request_sequences),
        tokenizer_threads=args.tokenizer_threads,
        max_attempts=args.max_attempts,
        engine_stream=args.engine_stream,
        breaker=BreakerSettings(failure_threshold=args.breaker_failures, open_s=args.breaker_open),
        probe=ProbeSettings(interval_s=args.health_interval, timeout_s=args.health_timeout),
        media_workers=args.media_workers,
        media_limits=media_limits.from_args(args),
        thinking_mode=args.thinking_mode,
        rate_limits=RateLimits(args.rate_limit_rps, args.rate_limit_tpm, args.rate_limit_concurrency),
        access_log=args.access_log,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from m3stack.gateway.api.app import create_app
    from m3stack.gateway.tokenize.tokenizer import TokenizerLoadError
    from m3stack.tracing import tracer_from_environment

    try:
        config = build_config(args)
        app = create_app(config, tracer_from_environment("m3stack-gateway"))
    except (ValueError, TokenizerLoadError) as exc:
        logger.error("%s", exc)
        return 2
    state = app.state.gateway

    class GatewayServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info(
                    "m3stack gateway ready on http://%s:%d (model %r, engines: %s)",
                    args.host,
                    args.port,
                    config.served_model_name,
                    ", ".join(state.pool.engines) or "none found yet",
                )

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn's own handler re-raises the signal after shutdown, so a clean drain would exit with
            # -15; here a drained gateway exits 0.  A second Ctrl-C still forces the exit.
            if not state.draining:
                logger.info("stopping: no new connections, open streams get %.0fs", args.drain_timeout)
            state.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    server = GatewayServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_config=None,
            access_log=False,  # ours instead (--access-log): JSON, with the request's id and tokens
            timeout_graceful_shutdown=int(args.drain_timeout) or None,
            timeout_keep_alive=args.keep_alive_timeout,
            lifespan="on",
        )
    )
    server.run()
    return 0 if server.started else 1
