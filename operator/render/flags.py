"""What the engine and gateway processes are told: the one mapping from the spec to `m3stack` flags.

Wiring (ports the probes and Services point at, the model path the volumes mount, the device the
GPU request implies, the engine Service address) goes on the command line.  Tunables go into the
ConfigMap as the ``M3STACK_<COMMAND>_<FLAG>`` variables every subcommand reads
(``m3stack/options.py``), so a change there rolls the pods through the config hash.
tests/operator/test_flags.py parses both with the real ``m3stack`` parser: a flag renamed in a
component's cli.py fails that test, not a pod at startup.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from m3stack.operator.render.names import engine_service_address
from m3stack.operator.spec import M3Deployment, RateLimits, RequestLimits
from m3stack.operator.spec_schema import ROUTING_POLICIES, THINKING_MODES
from m3stack.options import env_name

ENGINE_COMMAND = "engine"
GATEWAY_COMMAND = "gateway"
# Pods listen on every interface; only Services and probes reach them.
LISTEN_ALL = "0.0.0.0"
# Where the gateway finds the API keys Secret (spec.gateway.apiKeySecret), mounted read-only.
API_KEYS_DIR = "/etc/m3stack/api-keys"
# Set by the LeaderWorkerSet controller in every container of a group; the kubelet expands $(NAME) in args.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
T = TypeVar("T")


@dataclass(frozen=True)
class GatewayDefaults:
    """The operator's defaults (its --gateway-* flags, the chart's gatewayDefaults values) for the gateway
    settings an M3Deployment leaves unset; None here too: the gateway's own default (no variable rendered)."""

    thinking_mode: str | None = None  # the CRD's spelling: Adaptive, Enabled, Disabled
    limits: RequestLimits = field(default_factory=RequestLimits)
    rate_limits: RateLimits = field(default_factory=RateLimits)


GATEWAYS_OWN_DEFAULTS = GatewayDefaults()


def engine_args(m3d: M3Deployment) -> list[str]:
    engine = m3d.spec.engine
    return [
        ENGINE_COMMAND,
        "--model",
        m3d.spec.model.path,
        "--device",
        "cuda" if engine.accelerator.count > 0 else "cpu",
        "--host",
        LISTEN_ALL,
        "--port",
        str(engine.grpc_port),
        "--metrics-port",
        str(engine.metrics_port),
        *parallel_args(m3d),
        *engine.extra_args,
    ]


def parallel_args(m3d: M3Deployment) -> list[str]:
    """How the engine spreads over GPUs and, in a LeaderWorkerSet group, which node of it this pod is."""
    engine = m3d.spec.engine
    args = ["--tensor-parallel", str(engine.tensor_parallel)] if engine.tensor_parallel > 1 else []
    if engine.expert_parallel:
        args.append("--expert-parallel")
    multi = engine.multi_node
    if multi.size > 1:
        args += ["--nnodes", str(multi.size), "--node-rank", LWS_WORKER_INDEX, "--master-addr", LWS_LEADER_ADDRESS,
                 "--master-port", str(multi.rendezvous_port)]  # fmt: skip
    return args


def gateway_args(m3d: M3Deployment) -> list[str]:
    gateway = m3d.spec.gateway
    return [
        GATEWAY_COMMAND,
        "--model",
        m3d.spec.model.path,
        "--host",
        LISTEN_ALL,
        "--port",
        str(gateway.port),
        "--engine-service",
        f"{engine_service_address(m3d)}:{m3d.spec.engine.grpc_port}",
        *(["--api-key-file", f"{API_KEYS_DIR}/{gateway.api_key_secret.key}"] if gateway.api_key_secret else []),
        *gateway.extra_args,
    ]


def engine_settings(m3d: M3Deployment) -> dict[str, str]:
    """Tunables of the engine, flag -> value; a field left unset renders nothing (the engine's own default)."""
    engine = m3d.spec.engine
    return {
        "--served-model-name": m3d.spec.model.name,
        # The engine's own drain deadline after SIGTERM; terminationGracePeriodSeconds leaves room for it.
        "--drain-timeout": str(engine.drain.shutdown_timeout_seconds),
        "--index-dtype": engine.index_dtype,
        "--kv-cache-dtype": engine.kv_cache_dtype,
        **_set_only(
            {"--max-model-len": engine.max_model_len, "--gpu-memory-utilization": engine.gpu_memory_utilization}
        ),
    }


def gateway_settings(m3d: M3Deployment, defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS) -> dict[str, str]:
    """Tunables of the gateway, flag -> value: the resource's field, else the operator's default, else nothing
    (the gateway's own default)."""
    gateway = m3d.spec.gateway
    thinking_mode = _first_set(gateway.thinking_mode, defaults.thinking_mode)
    chosen = {
        "--max-request-bytes": _first_set(gateway.limits.max_request_bytes, defaults.limits.max_request_bytes),
        "--max-request-prompts": _first_set(gateway.limits.max_request_prompts, defaults.limits.max_request_prompts),
        "--max-request-sequences": _first_set(
            gateway.limits.max_request_sequences, defaults.limits.max_request_sequences
        ),
        "--thinking-mode": None if thinking_mode is None else THINKING_MODES[thinking_mode],
        "--rate-limit-rps": _first_set(
            gateway.rate_limits.requests_per_second, defaults.rate_limits.requests_per_second
        ),
        "--rate-limit-tpm": _first_set(gateway.rate_limits.tokens_per_minute, defaults.rate_limits.tokens_per_minute),
        "--rate-limit-concurrency": _first_set(
            gateway.rate_limits.concurrent_requests, defaults.rate_limits.concurrent_requests
        ),
    }
    return {
        "--served-model-name": m3d.spec.model.name,
        "--routing": ROUTING_POLICIES[gateway.routing_policy],
        "--drain-timeout": str(gateway.drain.shutdown_timeout_seconds),
        **_set_only(chosen),
    }


def _set_only(chosen: Mapping[str, object]) -> dict[str, str]:
    """The settings with a value, as text; None is left out, so the process's own default applies."""
    return {flag: str(value) for flag, value in chosen.items() if value is not None}


def _first_set(own: T | None, default: T | None) -> T | None:
    return default if own is None else own


def environment(command: str, settings: dict[str, str]) -> dict[str, str]:
    """``{"--drain-timeout": "300"}`` -> ``{"M3STACK_ENGINE_DRAIN_TIMEOUT": "300"}``."""
    return {env_name(command, flag): value for flag, value in settings.items()}
