"""The M3Deployment's spec schema: what a user writes (model, gateways, engines, autoscaling, exposure), with its
defaults, bounds and CEL rules, and the enums the render maps onto the components' flags.

``crd`` puts it into the CustomResourceDefinition; ``spec`` reads specs through
``schema.apply_defaults(SPEC_SCHEMA, ...)``, so the operator and the API server agree on defaults.
"""

from m3stack.operator.schema import (
    DNS_SUBDOMAIN_PATTERN,
    Schema,
    array,
    boolean,
    integer,
    number,
    obj,
    preserved,
    quantity,
    quantity_map,
    rule,
    string,
    string_map,
)
from m3stack.sizing import DEFAULT_CONTEXT, DEFAULT_MEMORY_UTILIZATION

# spec.gateway.routing.policy -> the gateway's --routing choice.
ROUTING_POLICIES = {"PrefixAware": "prefix-aware", "LeastInflight": "least-inflight"}
# spec.gateway.thinkingMode -> the gateway's --thinking-mode (m3stack.gateway.agentic.reasoning.THINKING_MODES).
THINKING_MODES = {"Adaptive": "adaptive", "Enabled": "enabled", "Disabled": "disabled"}
# The engine's --index-dtype values (m3stack.engine.kv_cache.tensors.INDEX_DTYPES).
INDEX_DTYPES = ("auto", "fp8_e4m3")
# The engine's --kv-cache-dtype values (m3stack.engine.kv_cache.tensors.KV_CACHE_DTYPES).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# No CRD default on the gateway settings the chart can default (gatewayDefaults values, the operator's
# --gateway-* flags): a default written into the stored object would hide that the field was left unset.
UNSET_GATEWAY_SETTING = (
    "A field left unset takes the operator's default (Helm values gatewayDefaults.*), else the gateway's own."
)
ABSOLUTE_PATH_RULE = rule("self.startsWith('/')", "must be an absolute path")
# Extended resource names such as nvidia.com/gpu or amd.com/gpu.
EXTENDED_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$"


def _image(component: str) -> Schema:
    return string(
        f"Container image of the {component}; the operator's default image (Helm value) when unset.",
        min_length=1,
        max_length=512,
    )


def _pull_policy() -> Schema:
    return string("Image pull policy.", default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"])


def _port(description: str, default: int) -> Schema:
    return integer(description, default=default, minimum=1, maximum=65535)


def _resources(description: str, default_requests: dict[str, str], default_limits: dict[str, str]) -> Schema:
    return obj(
        description,
        {
            "requests": quantity_map("Minimum resources the scheduler reserves (cpu, memory, ...)."),
            "limits": quantity_map("Maximum resources the container may use."),
        },
        default={"requests": default_requests, "limits": default_limits},
    )


def _drain(pre_stop_seconds: int, shutdown_timeout_seconds: int) -> Schema:
    return obj(
        "Graceful shutdown. The pod stays in service preStopSeconds after it leaves the endpoints (so "
        "routers notice), then gets SIGTERM and has shutdownTimeoutSeconds to finish in-flight requests; "
        "terminationGracePeriodSeconds is their sum plus 15 s.",
        {
            "preStopSeconds": integer(
                "Seconds between leaving the endpoints and SIGTERM.", default=pre_stop_seconds, minimum=0, maximum=300
            ),
            "shutdownTimeoutSeconds": integer(
                "Seconds after SIGTERM to finish in-flight requests before the rest are aborted.",
                default=shutdown_timeout_seconds,
                minimum=0,
                maximum=3600,
            ),
        },
        default={},
    )


def _toleration() -> Schema:
    return obj(
        "A toleration (core/v1 Toleration).",
        {
            "key": string("Taint key; empty with operator Exists matches every taint.", max_length=316),
            "operator": string("How the value is compared.", enum=["Exists", "Equal"]),
            "value": string("Taint value (operator Equal).", max_length=63),
            "effect": string(
                "Taint effect to tolerate; empty matches all.", enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]
            ),
            "tolerationSeconds": integer("How long a NoExecute taint is tolerated.", fmt="int64"),
        },
    )


def _scheduling_fields(component: str) -> dict[str, Schema]:
    return {
        "nodeSelector": string_map(f"Node labels the {component} pods require."),
        "tolerations": array(f"Taints the {component} pods tolerate.", _toleration(), max_items=32),
        "priorityClassName": string(
            f"PriorityClass of the {component} pods.", pattern=DNS_SUBDOMAIN_PATTERN, max_length=253
        ),
    }


def _env() -> Schema:
    variable = obj(
        "An environment variable (core/v1 EnvVar).",
        {
            "name": string("Variable name.", min_length=1, max_length=256),
            "value": string("Literal value.", max_length=32768),
            "valueFrom": preserved("A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef...)."),
        },
        required=["name"],
        rules=[rule("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both")],
    )
    return array(
        "Extra environment variables (secrets such as HF_TOKEN go here through valueFrom).",
        variable,
        max_items=64,
        list_type="map",
        map_keys=["name"],
    )


def _not_also_in_extra_args(field: str, flag: str) -> Schema:
    """Refuses an engine field together with its flag in extraArgs.  Refused rather than resolved: the flag on
    the command line wins over the ConfigMap variable the field renders (``m3stack.options``), so the field
    would silently lose, and the Fits condition could not tell which value the engine runs with.  The API
    server names both when they are written; a flag in extraArgs alone stays valid (resources written before
    the field existed)."""
    return rule(
        f"!has(self.{field}) || !has(self.extraArgs) "
        f"|| !self.extraArgs.exists(a, a == '{flag}' || a.startsWith('{flag}='))",
        f"set engine.{field} or {flag} in engine.extraArgs, not both",
        field_path=f".{field}",
    )


def _extra_args(command: str) -> Schema:
    return array(
        f"Flags appended to `m3stack {command}` (for settings this resource does not model).",
        string("One argument.", max_length=1024),
        max_items=64,
    )


MODEL_SCHEMA = obj(
    "The checkpoint to serve (Hugging Face layout: config.json, safetensors shards, tokenizer, preprocessor).",
    {
        "name": string(
            "Model name clients send in requests (OpenAI `model`).",
            min_length=1,
            max_length=128,
            pattern=r"^[A-Za-z0-9][-A-Za-z0-9._/:]*$",
        ),
        "path": string(
            "Checkpoint folder inside the pods (absolute), or 'default' for the embedded tiny random-weight model.",
            default="default",
            max_length=1024,
            rules=[rule("self == 'default' || self.startsWith('/')", "must be an absolute path or 'default'")],
        ),
        "pvc": obj(
            "A PersistentVolumeClaim holding the checkpoint, mounted read-only in engine and gateway pods.",
            {
                "claimName": string("Name of the claim.", min_length=1, pattern=DNS_SUBDOMAIN_PATTERN),
                "mountPath": string(
                    "Where the claim is mounted.", default="/models", max_length=512, rules=[ABSOLUTE_PATH_RULE]
                ),
            },
            required=["claimName"],
        ),
    },
    required=["name"],
    rules=[
        rule(
            "!has(self.pvc) || self.path == self.pvc.mountPath || self.path.startsWith(self.pvc.mountPath + '/')",
            "model.path must lie under model.pvc.mountPath",
            field_path=".path",
        )
    ],
)

GATEWAY_SCHEMA = obj(
    "The CPU tier: OpenAI-compatible HTTP API, tokenization, image/video preprocessing, routing to engines.",
    {
        "replicas": integer(
            "Gateway pods (ignored while autoscaling.gateway is enabled).", default=2, minimum=0, maximum=1000
        ),
        "image": _image("gateway"),
        "imagePullPolicy": _pull_policy(),
        "port": _port("HTTP port of the API.", 8000),
        "routing": obj(
            "How requests are spread over engines.",
            {
                "policy": string(
                    "PrefixAware: prefer the engine holding the longest cached prefix, traded against its load; "
                    "LeastInflight: the engine with the fewest requests in flight.",
                    default="PrefixAware",
                    enum=list(ROUTING_POLICIES),
                )
            },
            default={},
        ),
        "apiKeySecret": obj(
            "Require `Authorization: Bearer <key>`: the accepted keys, one per line, in a Secret (re-read when "
            "it changes).",
            {
                "name": string("Secret name.", min_length=1, pattern=DNS_SUBDOMAIN_PATTERN),
                "key": string("Key of the Secret holding the keys.", default="keys", min_length=1, max_length=253),
            },
            required=["name"],
        ),
        "limits": obj(
            "What one request may ask for, checked before any work (the gateway's --max-request-* flags; the "
            f"README's limits section lists every limit). {UNSET_GATEWAY_SETTING}",
            {
                "maxRequestBytes": integer(
                    "Largest request body; larger is a 413 (send big images and videos by URL). Gateway's "
                    "default: 8 MiB.",
                    minimum=1,
                    fmt="int64",
                ),
                "maxRequestPrompts": integer(
                    "Most prompts in one /v1/completions request; more is a 400. Gateway's default: 256.", minimum=1
                ),
                "maxRequestSequences": integer(
                    "Most sequences (prompts x n) one request may start; more is a 400. Keep it within the "
                    "engines' waiting queue (--max-queue, 1024). Gateway's default: 256.",
                    minimum=1,
                ),
            },
            default={},
        ),
        "thinkingMode": string(
            "M3's reasoning for chat requests that do not choose (the gateway's --thinking-mode): Adaptive lets the "
            "model decide, Enabled makes it think first, Disabled skips it. The reasoning comes back as "
            "reasoning_content; a request chooses with chat_template_kwargs (thinking_mode or enable_thinking). "
            f"{UNSET_GATEWAY_SETTING} Gateway's default: Adaptive.",
            enum=list(THINKING_MODES),
        ),
        "rateLimits": obj(
            "Per API key limits of each gateway on the completion routes (429 with Retry-After); 0 = no limit. "
            "Without apiKeySecret all clients share one key. Each gateway pod counts on its own. "
            f"{UNSET_GATEWAY_SETTING} Gateway's default: no limit.",
            {
                "requestsPerSecond": number("Requests per second, in bursts of up to max(1, this).", minimum=0),
                "tokensPerMinute": integer(
                    "Prompt + completion tokens per minute, charged as each request ends.", minimum=0
                ),
                "concurrentRequests": integer("Requests running at once.", minimum=0),
            },
            default={},
        ),
        "resources": _resources("Gateway container resources.", {"cpu": "2", "memory": "4Gi"}, {"memory": "8Gi"}),
        "drain": _drain(pre_stop_seconds=10, shutdown_timeout_seconds=60),
        "env": _env(),
        "extraArgs": _extra_args("gateway"),
        **_scheduling_fields("gateway"),
    },
    default={},
)

ENGINE_SCHEMA = obj(
    "The GPU tier: engine pods running the model behind gRPC (engine.proto).",
    {
        "replicas": integer(
            "Engine pods. This is the /scale subresource: `kubectl scale m3d/NAME --replicas=N`, HPA and KEDA "
            "write it.",
            default=1,
            minimum=0,
            maximum=1000,
        ),
        "image": _image("engine"),
        "imagePullPolicy": _pull_policy(),
        "accelerator": obj(
            "GPUs per engine pod.",
            {
                "resource": string(
                    "Extended resource name of the device.",
                    default="nvidia.com/gpu",
                    pattern=EXTENDED_RESOURCE_PATTERN,
                    max_length=253,
                ),
                "count": integer("Devices per engine pod; 0 runs the engine on CPU.", default=1, minimum=0, maximum=16),
                "product": string(
                    "Required GPU product (node label nvidia.com/gpu.product), e.g. NVIDIA-H200 or NVIDIA-B200.",
                    min_length=1,
                    max_length=63,
                    pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
                ),
            },
            default={},
            rules=[rule("!has(self.product) || self.count > 0", "accelerator.product needs accelerator.count > 0")],
        ),
        "parallelism": obj(
            "How one engine spreads the model over its devices (engine flags --tensor-parallel, --expert-parallel).",
            {
                "tensor": integer(
                    "Tensor-parallel degree: GPUs of one engine, over all its nodes (accelerator.count x "
                    "multiNode.size when multiNode.size > 1).",
                    default=1,
                    minimum=1,
                    maximum=512,
                ),
                "expert": boolean(
                    "MoE layers: whole experts per GPU (expert parallelism) instead of a slice of every expert.",
                    default=False,
                ),
            },
            default={},
        ),
        "multiNode": obj(
            "One engine over several nodes: with size > 1 each engine replica is a LeaderWorkerSet group of `size` "
            "pods (the leader schedules and serves gRPC; workers join it at the leader's address).  Needs the "
            "LeaderWorkerSet CRD and controller (sigs.k8s.io/lws) in the cluster.",
            {
                "size": integer("Pods (nodes) per engine.", default=1, minimum=1, maximum=64),
                "rendezvousPort": integer(
                    "Port on the leader where the engine's ranks meet (torch.distributed).",
                    default=29500,
                    minimum=1024,
                    maximum=65535,
                ),
            },
            default={},
        ),
        # No CRD default on these two: a default written into every stored object would clash with the same flag
        # in extraArgs (refused below) and hide that the engine's own default applies.
        "maxModelLen": integer(
            "Context limit per request, prompt plus output tokens (the engine's --max-model-len); longer requests "
            "are refused with context_length_exceeded. Unset: the model's own limit, capped by what the KV cache "
            f"holds (the Fits condition then checks room for {DEFAULT_CONTEXT} tokens).",
            minimum=1,
        ),
        "gpuMemoryUtilization": number(
            "Fraction of each GPU's memory the engine may fill with weights, activations and the KV cache (the "
            "engine's --gpu-memory-utilization); what is left after weights and activations is the KV cache, "
            f"unless --kv-cache-gb in extraArgs sizes it. Unset: the engine's default, {DEFAULT_MEMORY_UTILIZATION}.",
            minimum=0,
            maximum=1,
            exclusive_minimum=True,
        ),
        "resources": _resources(
            "Engine container CPU and memory (the device count comes from accelerator; the memory request and "
            "limit grow by kvCache.cpuOffload.size).",
            {"cpu": "8", "memory": "64Gi"},
            {"memory": "64Gi"},
        ),
        "kvCache": obj(
            "KV cache placement.",
            {
                "cpuOffload": obj(
                    "KV blocks offloaded to pinned host memory; the size is added to the pod's memory request.",
                    {"size": quantity("Host memory for offloaded KV blocks (0 disables offload).", default="0")},
                    default={},
                ),
                "indexDtype": string(
                    "Storage of the MSA k-index (the engine's --index-dtype): auto keeps the model's dtype; fp8_e4m3 "
                    "stores 8-bit keys with a float32 scale per token, half the bytes each decode step's index scan "
                    "reads.",
                    default="auto",
                    enum=INDEX_DTYPES,
                ),
                "dtype": string(
                    "Storage of K and V (the engine's --kv-cache-dtype): auto keeps the model's dtype; fp8_e4m3 stores "
                    "8-bit K and V (clamped to e4m3's range, scale 1), twice the tokens in the same memory; attention "
                    "then runs in Triton kernels only.",
                    default="auto",
                    enum=KV_CACHE_DTYPES,
                ),
            },
            default={},
        ),
        "grpcPort": _port("gRPC port (engine.proto and grpc.health.v1).", 50051),
        "metricsPort": _port("HTTP port for /metrics, /loaded and /health.", 9400),
        "startup": obj(
            "Model loading.",
            {
                "timeoutSeconds": integer(
                    "How long the model may take to load before the pod is restarted (startupProbe).",
                    default=1800,
                    minimum=30,
                    maximum=86400,
                )
            },
            default={},
        ),
        "drain": _drain(pre_stop_seconds=15, shutdown_timeout_seconds=300),
        "shmSize": quantity("Size of the memory-backed /dev/shm.", default="16Gi"),
        "kernelCache": obj(
            "Where the engine keeps the GPU kernels it compiles (Triton, FlashInfer JIT). By default the pod's "
            "/tmp: a restarted container finds them, but every new pod compiles them again during its warm-up "
            "(about 1.5 minutes on an H200 before it is ready). A ReadWriteMany claim shared by the engine pods "
            "keeps them for every pod.",
            {"claimName": string("Name of the claim.", min_length=1, pattern=DNS_SUBDOMAIN_PATTERN)},
            default={},
        ),
        "env": _env(),
        "extraArgs": _extra_args("engine"),
        "networkPolicy": boolean(
            "A NetworkPolicy letting only this resource's gateways reach the engines' gRPC port (the engine "
            "trusts its callers' media content hashes), its engine pods reach each other, and anyone the metrics "
            "port.",
            default=True,
        ),
        **_scheduling_fields("engine"),
    },
    default={},
    rules=[
        rule("self.grpcPort != self.metricsPort", "engine.grpcPort and engine.metricsPort must differ"),
        _not_also_in_extra_args("maxModelLen", "--max-model-len"),
        _not_also_in_extra_args("gpuMemoryUtilization", "--gpu-memory-utilization"),
        rule(
            "self.multiNode.size > 1 || self.accelerator.count == 0 "
            "|| self.parallelism.tensor <= self.accelerator.count",
            "parallelism.tensor must not exceed accelerator.count",
            field_path=".parallelism.tensor",
        ),
        rule(
            "self.multiNode.size == 1 || (self.accelerator.count > 0 "
            "&& self.parallelism.tensor == self.accelerator.count * self.multiNode.size)",
            "with multiNode.size > 1, parallelism.tensor must equal accelerator.count x multiNode.size (GPUs per pod "
            "times pods)",
            field_path=".parallelism.tensor",
        ),
        rule(
            "self.multiNode.size == 1 || self.multiNode.rendezvousPort != self.grpcPort "
            "&& self.multiNode.rendezvousPort != self.metricsPort",
            "engine.multiNode.rendezvousPort must differ from grpcPort and metricsPort",
            field_path=".multiNode.rendezvousPort",
        ),
    ],
)

ENGINE_AUTOSCALING_SCHEMA = obj(
    "Engine autoscaling on in-flight requests (Knative KPA math with GPU-friendly windows).",
    {
        "mode": string(
            "Builtin: the operator's concurrency autoscaler; KEDA or HPA: external autoscalers driving /scale; "
            "None: engine replicas stay as set.",
            default="None",
            enum=["Builtin", "KEDA", "HPA", "None"],
        ),
        "minReplicas": integer(
            "Fewest engines; 0 lets an idle deployment scale to zero (Builtin and KEDA: the gateways' 503s "
            "while no engine is ready wake it).",
            default=1,
            minimum=0,
            maximum=1000,
        ),
        "maxReplicas": integer("Most engines.", default=8, minimum=1, maximum=1000),
        "targetConcurrency": integer("In-flight requests one engine is sized for.", default=64, minimum=1),
        "targetUtilization": number(
            "Fraction of targetConcurrency to aim for.", default=0.7, minimum=0, maximum=1, exclusive_minimum=True
        ),
        "stableWindowSeconds": integer("Averaging window in normal mode.", default=180, minimum=6, maximum=3600),
        "panicWindowSeconds": integer("Averaging window in panic mode.", default=60, minimum=1, maximum=3600),
        "panicThreshold": number(
            "Demand over ready capacity that starts panic mode.", default=2.0, minimum=1, exclusive_minimum=True
        ),
        "maxScaleUpRate": number("Largest growth factor per decision.", default=2.0, minimum=1, exclusive_minimum=True),
        "maxScaleDownRate": number(
            "Largest shrink factor per decision.", default=2.0, minimum=1, exclusive_minimum=True
        ),
        "scaleDownDelaySeconds": integer(
            "Scale down only to the highest decision of this window.", default=300, minimum=0, maximum=3600
        ),
        "prometheus": obj(
            "Where KEDA reads the gateways' metrics (mode KEDA). This Prometheus must scrape the gateways' "
            "/metrics with `namespace` and `service` labels, as a ServiceMonitor on the gateway Service does.",
            {
                "serverAddress": string(
                    "Prometheus base URL, e.g. http://prometheus-operated.monitoring:9090.",
                    min_length=1,
                    max_length=2048,
                    pattern=r"^https?://",
                ),
                "query": string(
                    "PromQL giving this resource's total in-flight engine requests (default: the sum of "
                    "m3stack_gateway_engine_inflight_requests over its gateway Service).",
                    min_length=1,
                    max_length=4096,
                ),
            },
            required=["serverAddress"],
        ),
    },
    default={},
    rules=[
        rule("self.minReplicas <= self.maxReplicas", "autoscaling.engine.minReplicas must be <= maxReplicas"),
        rule(
            "self.panicWindowSeconds <= self.stableWindowSeconds",
            "autoscaling.engine.panicWindowSeconds must be <= stableWindowSeconds",
        ),
        rule(
            "self.mode != 'KEDA' || has(self.prometheus)",
            "autoscaling.engine.prometheus.serverAddress is required in mode KEDA",
        ),
        rule(
            "self.mode != 'HPA' || self.minReplicas >= 1",
            "autoscaling.engine.minReplicas must be >= 1 in mode HPA (a HorizontalPodAutoscaler cannot scale "
            "to zero; KEDA and Builtin can)",
        ),
    ],
)

GATEWAY_AUTOSCALING_SCHEMA = obj(
    "Gateway autoscaling: a CPU HorizontalPodAutoscaler on the gateway Deployment.",
    {
        "enabled": boolean("Create the HPA (the gateway's replicas field is then left to it).", default=False),
        "minReplicas": integer("Fewest gateways.", default=2, minimum=1, maximum=1000),
        "maxReplicas": integer("Most gateways.", default=16, minimum=1, maximum=1000),
        "targetCPUUtilizationPercentage": integer("Average CPU to aim for.", default=60, minimum=1, maximum=100),
    },
    default={},
    rules=[rule("self.minReplicas <= self.maxReplicas", "autoscaling.gateway.minReplicas must be <= maxReplicas")],
)

EXPOSURE_SCHEMA = obj(
    "How clients reach the gateway.",
    {
        "service": obj(
            "The gateway Service.",
            {"type": string("Service type.", default="ClusterIP", enum=["ClusterIP", "NodePort", "LoadBalancer"])},
            default={},
        ),
        "ingress": obj(
            "An Ingress in front of the gateway Service (streaming responses: disable proxy buffering in the "
            "annotations of your controller).",
            {
                "host": string("Host name.", pattern=DNS_SUBDOMAIN_PATTERN),
                "className": string("IngressClass.", pattern=DNS_SUBDOMAIN_PATTERN),
                "path": string("Path prefix.", default="/", max_length=512, rules=[ABSOLUTE_PATH_RULE]),
                "annotations": string_map("Annotations for the Ingress controller.", value_max_length=4096),
                "tls": obj(
                    "Serve HTTPS with a certificate Secret.",
                    {"secretName": string("TLS Secret name.", min_length=1, pattern=DNS_SUBDOMAIN_PATTERN)},
                    required=["secretName"],
                ),
            },
            rules=[rule("!has(self.tls) || has(self.host)", "exposure.ingress.tls needs exposure.ingress.host")],
        ),
    },
    default={},
)

SPEC_SCHEMA = obj(
    "Desired state of one served model: gateways and engines.",
    {
        "suspend": boolean("Scale gateways and engines to zero while keeping everything else.", default=False),
        "model": MODEL_SCHEMA,
        "gateway": GATEWAY_SCHEMA,
        "engine": ENGINE_SCHEMA,
        "autoscaling": obj(
            "Autoscaling of engines and gateways.",
            {"engine": ENGINE_AUTOSCALING_SCHEMA, "gateway": GATEWAY_AUTOSCALING_SCHEMA},
            default={},
        ),
        "exposure": EXPOSURE_SCHEMA,
    },
    required=["model"],
)
