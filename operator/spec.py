"""A typed, defaulted view of an M3Deployment: what the render functions read.

Defaults come from the CRD schema itself (``schema.apply_defaults``), so a spec read here equals the
spec the API server stores, whether or not the object came through an API server.  The gateway settings
the chart can default (``spec_schema.UNSET_GATEWAY_SETTING``) have no CRD default and stay None when unset; the
render resolves them against the operator's ``GatewayDefaults``.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from m3stack.operator.quantity import parse_quantity
from m3stack.operator.schema import apply_defaults
from m3stack.operator.spec_schema import SPEC_SCHEMA

# Seconds on top of preStop + shutdown timeout before the kubelet kills a terminating pod.
TERMINATION_MARGIN_SECONDS = 15


@dataclass(frozen=True)
class Drain:
    pre_stop_seconds: int
    shutdown_timeout_seconds: int

    @property
    def termination_grace_period_seconds(self) -> int:
        return self.pre_stop_seconds + self.shutdown_timeout_seconds + TERMINATION_MARGIN_SECONDS


@dataclass(frozen=True)
class Resources:
    requests: dict[str, str | int] = field(default_factory=dict)
    limits: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class Scheduling:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority_class_name: str | None = None


@dataclass(frozen=True)
class Model:
    name: str
    path: str
    pvc_claim_name: str | None
    pvc_mount_path: str | None


@dataclass(frozen=True)
class SecretKey:
    name: str
    key: str


@dataclass(frozen=True)
class RequestLimits:
    """spec.gateway.limits: the gateway's --max-request-bytes, --max-request-prompts, --max-request-sequences.
    None: left unset (the operator's default applies, else the gateway's)."""

    max_request_bytes: int | None = None
    max_request_prompts: int | None = None
    max_request_sequences: int | None = None


@dataclass(frozen=True)
class RateLimits:
    """spec.gateway.rateLimits: the gateway's --rate-limit-rps, --rate-limit-tpm, --rate-limit-concurrency.
    None: left unset (the operator's default applies, else the gateway's)."""

    requests_per_second: float | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None


@dataclass(frozen=True)
class Gateway:
    replicas: int
    image: str | None
    pull_policy: str
    port: int
    routing_policy: str
    api_key_secret: SecretKey | None
    limits: RequestLimits
    thinking_mode: str | None  # spec.gateway.thinkingMode (Adaptive, Enabled, Disabled); None: unset
    rate_limits: RateLimits
    resources: Resources
    drain: Drain
    env: list[dict[str, Any]]
    extra_args: list[str]
    scheduling: Scheduling


@dataclass(frozen=True)
class Accelerator:
    resource: str
    count: int
    product: str | None


@dataclass(frozen=True)
class MultiNode:
    size: int  # pods per engine; > 1 renders a LeaderWorkerSet
    rendezvous_port: int


@dataclass(frozen=True)
class Engine:
    replicas: int
    image: str | None
    pull_policy: str
    accelerator: Accelerator
    tensor_parallel: int
    expert_parallel: bool
    multi_node: MultiNode
    max_model_len: int | None  # the engine's --max-model-len; None: unset, the engine's own default
    gpu_memory_utilization: float | None  # the engine's --gpu-memory-utilization; None: unset, likewise
    resources: Resources
    cpu_offload_bytes: int
    index_dtype: str  # the engine's --index-dtype
    kv_cache_dtype: str  # the engine's --kv-cache-dtype
    grpc_port: int
    metrics_port: int
    startup_timeout_seconds: int
    drain: Drain
    shm_size: str | int
    kernel_cache_claim: str | None  # a claim shared by the engine pods for compiled kernels; None: the pod's /tmp
    env: list[dict[str, Any]]
    extra_args: list[str]
    scheduling: Scheduling
    network_policy: bool


@dataclass(frozen=True)
class Prometheus:
    server_address: str
    query: str | None


@dataclass(frozen=True)
class EngineAutoscaling:
    mode: str
    min_replicas: int
    max_replicas: int
    target_concurrency: int
    target_utilization: float
    stable_window_seconds: int
    panic_window_seconds: int
    panic_threshold: float
    max_scale_up_rate: float
    max_scale_down_rate: float
    scale_down_delay_seconds: int
    prometheus: Prometheus | None


@dataclass(frozen=True)
class GatewayAutoscaling:
    enabled: bool
    min_replicas: int
    max_replicas: int
    target_cpu_utilization_percentage: int


@dataclass(frozen=True)
class Ingress:
    host: str | None
    class_name: str | None
    path: str
    annotations: dict[str, str]
    tls_secret_name: str | None


@dataclass(frozen=True)
class Exposure:
    service_type: str
    ingress: Ingress | None


@dataclass(frozen=True)
class M3DeploymentSpec:
    suspend: bool
    model: Model
    gateway: Gateway
    engine: Engine
    engine_autoscaling: EngineAutoscaling
    gateway_autoscaling: GatewayAutoscaling
    exposure: Exposure

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "M3DeploymentSpec":
        spec = apply_defaults(SPEC_SCHEMA, dict(raw))
        autoscaling = spec["autoscaling"]
        return cls(
            suspend=spec["suspend"],
            model=_model(spec["model"]),
            gateway=_gateway(spec["gateway"]),
            engine=_engine(spec["engine"]),
            engine_autoscaling=_engine_autoscaling(autoscaling["engine"]),
            gateway_autoscaling=_gateway_autoscaling(autoscaling["gateway"]),
            exposure=_exposure(spec["exposure"]),
        )


@dataclass(frozen=True)
class M3Deployment:
    """One custom resource: identity plus its defaulted spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: M3DeploymentSpec

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "M3Deployment":
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta.get("uid", ""),
            generation=int(meta.get("generation", 0)),
            spec=M3DeploymentSpec.from_dict(body.get("spec", {})),
        )


def _model(raw: Mapping[str, Any]) -> Model:
    pvc = raw.get("pvc")
    return Model(
        name=raw["name"],
        path=raw["path"],
        pvc_claim_name=pvc["claimName"] if pvc else None,
        pvc_mount_path=pvc["mountPath"] if pvc else None,
    )


def _drain(raw: Mapping[str, Any]) -> Drain:
    return Drain(pre_stop_seconds=raw["preStopSeconds"], shutdown_timeout_seconds=raw["shutdownTimeoutSeconds"])


def _resources(raw: Mapping[str, Any]) -> Resources:
    return Resources(requests=dict(raw.get("requests", {})), limits=dict(raw.get("limits", {})))


def _scheduling(raw: Mapping[str, Any]) -> Scheduling:
    return Scheduling(
        node_selector=dict(raw.get("nodeSelector", {})),
        tolerations=list(raw.get("tolerations", [])),
        priority_class_name=raw.get("priorityClassName"),
    )


def _gateway(raw: Mapping[str, Any]) -> Gateway:
    return Gateway(
        replicas=raw["replicas"],
        image=raw.get("image"),
        pull_policy=raw["imagePullPolicy"],
        port=raw["port"],
        routing_policy=raw["routing"]["policy"],
        api_key_secret=SecretKey(**raw["apiKeySecret"]) if "apiKeySecret" in raw else None,
        limits=RequestLimits(
            raw["limits"].get("maxRequestBytes"),
            raw["limits"].get("maxRequestPrompts"),
            raw["limits"].get("maxRequestSequences"),
        ),
        thinking_mode=raw.get("thinkingMode"),
        rate_limits=RateLimits(
            raw["rateLimits"].get("requestsPerSecond"),
            raw["rateLimits"].get("tokensPerMinute"),
            raw["rateLimits"].get("concurrentRequests"),
        ),
        resources=_resources(raw["resources"]),
        drain=_drain(raw["drain"]),
        env=list(raw.get("env", [])),
        extra_args=list(raw.get("extraArgs", [])),
        scheduling=_scheduling(raw),
    )


def _engine(raw: Mapping[str, Any]) -> Engine:
    accelerator = raw["accelerator"]
    return Engine(
        replicas=raw["replicas"],
        image=raw.get("image"),
        pull_policy=raw["imagePullPolicy"],
        accelerator=Accelerator(
            resource=accelerator["resource"], count=accelerator["count"], product=accelerator.get("product")
        ),
        tensor_parallel=raw["parallelism"]["tensor"],
        expert_parallel=raw["parallelism"]["expert"],
        multi_node=MultiNode(size=raw["multiNode"]["size"], rendezvous_port=raw["multiNode"]["rendezvousPort"]),
        max_model_len=raw.get("maxModelLen"),
        gpu_memory_utilization=None if "gpuMemoryUtilization" not in raw else float(raw["gpuMemoryUtilization"]),
        resources=_resources(raw["resources"]),
        cpu_offload_bytes=int(parse_quantity(raw["kvCache"]["cpuOffload"]["size"])),
        index_dtype=raw["kvCache"]["indexDtype"],
        kv_cache_dtype=raw["kvCache"]["dtype"],
        grpc_port=raw["grpcPort"],
        metrics_port=raw["metricsPort"],
        startup_timeout_seconds=raw["startup"]["timeoutSeconds"],
        drain=_drain(raw["drain"]),
        shm_size=raw["shmSize"],
        kernel_cache_claim=raw["kernelCache"].get("claimName"),
        env=list(raw.get("env", [])),
        extra_args=list(raw.get("extraArgs", [])),
        scheduling=_scheduling(raw),
        network_policy=raw["networkPolicy"],
    )


def _engine_autoscaling(raw: Mapping[str, Any]) -> EngineAutoscaling:
    return EngineAutoscaling(
        mode=raw["mode"],
        min_replicas=raw["minReplicas"],
        max_replicas=raw["maxReplicas"],
        target_concurrency=raw["targetConcurrency"],
        target_utilization=float(raw["targetUtilization"]),
        stable_window_seconds=raw["stableWindowSeconds"],
        panic_window_seconds=raw["panicWindowSeconds"],
        panic_threshold=float(raw["panicThreshold"]),
        max_scale_up_rate=float(raw["maxScaleUpRate"]),
        max_scale_down_rate=float(raw["maxScaleDownRate"]),
        scale_down_delay_seconds=raw["scaleDownDelaySeconds"],
        prometheus=_prometheus(raw.get("prometheus")),
    )


def _prometheus(raw: Mapping[str, Any] | None) -> Prometheus | None:
    return None if raw is None else Prometheus(server_address=raw["serverAddress"], query=raw.get("query"))


def _gateway_autoscaling(raw: Mapping[str, Any]) -> GatewayAutoscaling:
    return GatewayAutoscaling(
        enabled=raw["enabled"],
        min_replicas=raw["minReplicas"],
        max_replicas=raw["maxReplicas"],
        target_cpu_utilization_percentage=raw["targetCPUUtilizationPercentage"],
    )


def _exposure(raw: Mapping[str, Any]) -> Exposure:
    ingress = raw.get("ingress")
    return Exposure(
        service_type=raw["service"]["type"],
        ingress=None
        if ingress is None
        else Ingress(
            host=ingress.get("host"),
            class_name=ingress.get("className"),
            path=ingress["path"],
            annotations=dict(ingress.get("annotations", {})),
            tls_secret_name=ingress["tls"]["secretName"] if "tls" in ingress else None,
        ),
    )
