"""Everything a gateway process is configured with (built from the CLI flags, or directly in tests): what
``app.create_app`` builds the gateway from."""

from dataclasses import dataclass, field
from pathlib import Path

from m3stack.gateway.api.rate_limit import RateLimits
from m3stack.gateway.api.request_limits import DEFAULT_MAX_REQUEST_BYTES, RequestLimits
from m3stack.gateway.engine_client.breaker import BreakerSettings
from m3stack.gateway.engine_client.client import ProbeSettings
from m3stack.gateway.multimodal import MediaLimits


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path  # tokenizer and chat template
    served_model_name: str
    engines: tuple[str, ...] = ()  # static HOST:PORT list
    engine_service: tuple[str, int] | None = None  # (DNS name of a headless Service, gRPC port)
    discovery_interval_s: float = 5.0
    routing: str = "least-inflight"
    prefix_load_penalty: float = 0.1
    api_key_file: Path | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # prompts and sequences per request
    tokenizer_threads: int = 2
    max_attempts: int = 3  # engines tried per request before its first token
    engine_stream: str = "shared"  # shared: one GenerateStream per engine; request: a Generate call per request
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    media_workers: int | None = None  # image/video worker processes; None: one per core, 0: no media input
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    access_log: bool = True  # one JSON line per API request (gateway/api/access_log.py)
    thinking_mode: str = "adaptive"  # M3's reasoning for chat requests that do not choose
    rate_limits: RateLimits = field(default_factory=RateLimits)  # per API key

    def __post_init__(self) -> None:
        if self.engine_stream not in ("shared", "request"):
            raise ValueError(f"engine_stream must be shared or request, not {self.engine_stream!r}")
        if not self.engines and self.engine_service is None:
            raise ValueError("give the engines: a HOST:PORT list or the DNS name of their headless Service")
