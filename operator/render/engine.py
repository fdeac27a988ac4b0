"""The engine tier: Deployment (GPU pods), headless gRPC Service, PodDisruptionBudget."""

import math
from typing import Any

from m3stack.operator.quantity import format_bytes, parse_quantity
from m3stack.operator.render import pods
from m3stack.operator.render.flags import engine_args
from m3stack.operator.render.names import ENGINE, child_metadata, selector_labels
from m3stack.operator.spec import Engine, M3Deployment

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GRPC_PORT_NAME = "grpc"
METRICS_PORT_NAME = "metrics"
STARTUP_PROBE_PERIOD_SECONDS = 10
SHM_VOLUME = "dshm"
KERNEL_CACHE_VOLUME = "kernel-cache"
KERNEL_CACHE_PATH = "/var/cache/m3stack"
# A Deployment reports ProgressDeadlineExceeded this long after a model was allowed to finish loading.
PROGRESS_MARGIN_SECONDS = 600


def engine_resources(engine: Engine) -> dict[str, Any]:
    """Requests and limits: memory grows by the CPU KV offload pool, devices come from the accelerator."""
    requests = dict(engine.resources.requests)
    limits = dict(engine.resources.limits)
    if engine.cpu_offload_bytes:
        for bucket in (requests, limits):
            if "memory" in bucket:
                bucket["memory"] = format_bytes(parse_quantity(bucket["memory"]) + engine.cpu_offload_bytes)
        requests.setdefault("memory", format_bytes(engine.cpu_offload_bytes))
    if engine.accelerator.count:
        # Extended resources are requested through limits (requests default to them).
        limits[engine.accelerator.resource] = engine.accelerator.count
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _kernel_cache_env(engine: Engine) -> list[dict[str, Any]]:
    """Triton's and FlashInfer's compile caches on the shared claim (the spec's own variables win)."""
    if engine.kernel_cache_claim is None:
        return []
    ours = [{"name": "TRITON_CACHE_DIR", "value": f"{KERNEL_CACHE_PATH}/triton"},
            {"name": "FLASHINFER_WORKSPACE_BASE", "value": KERNEL_CACHE_PATH}]  # fmt: skip
    names = {variable["name"] for variable in engine.env}
    return [variable for variable in ours if variable["name"] not in names]


def _container(m3d: M3Deployment, image: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    engine = m3d.spec.engine
    env = [*_kernel_cache_env(engine), *engine.env]
    return {
        **pods.m3stack_container(m3d, ENGINE, image, engine.pull_policy, engine_args(m3d), env),
        "ports": [
            {"name": GRPC_PORT_NAME, "containerPort": engine.grpc_port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": engine.metrics_port, "protocol": "TCP"},
        ],
        # /loaded answers 200 only once the weights are on the device: loading may take many minutes.
        "startupProbe": {
            "httpGet": {"path": "/loaded", "port": METRICS_PORT_NAME},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(engine.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        },
        # /ready: loaded, admitting requests, not draining: the pod takes traffic only when it can serve
        # (and leaves the headless Service's DNS as soon as it starts draining).
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": METRICS_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 2,
        },
        # /health fails only when the engine loop died: a busy or draining engine is not restarted.
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": METRICS_PORT_NAME},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
        **pods.pre_stop(engine.drain),
        "resources": engine_resources(engine),
        "volumeMounts": [*mounts, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }


def engine_deployment(m3d: M3Deployment, image: str, config_hash: str) -> dict[str, Any]:
    engine = m3d.spec.engine
    volumes, mounts = pods.model_volumes(m3d)
    volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": engine.shm_size}})
    if engine.kernel_cache_claim is not None:
        volumes.append({"name": KERNEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": engine.kernel_cache_claim}})
        mounts = [*mounts, {"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_PATH}]
    node_selector = {GPU_PRODUCT_LABEL: engine.accelerator.product} if engine.accelerator.product else {}
    # GPU node pools are commonly tainted with the device resource name (GKE, AKS, the GPU operator).
    gpu_toleration = (
        [{"key": engine.accelerator.resource, "operator": "Exists", "effect": "NoSchedule"}]
        if engine.accelerator.count
        else []
    )
    return pods.deployment(
        m3d,
        ENGINE,
        replicas=0 if m3d.spec.suspend else engine.replicas,
        # GPUs are scarce: replace one engine at a time instead of surging extra ones.
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        container=_container(m3d, image, mounts),
        volumes=volumes,
        drain=engine.drain,
        scheduling=pods.scheduling_fields(engine.scheduling, node_selector, gpu_toleration),
        config_hash=config_hash,
        extra_spec={"progressDeadlineSeconds": engine.startup_timeout_seconds + PROGRESS_MARGIN_SECONDS},
    )


def engine_service(m3d: M3Deployment) -> dict[str, Any]:
    """Headless: DNS returns one address per ready engine, and the gateway keeps a channel to each
    (a ClusterIP would pin every HTTP/2 connection to one pod)."""
    engine = m3d.spec.engine
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(m3d, ENGINE),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(m3d, ENGINE),
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": GRPC_PORT_NAME,
                    "port": engine.grpc_port,
                    "targetPort": GRPC_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": METRICS_PORT_NAME,
                    "port": engine.metrics_port,
                    "targetPort": METRICS_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                },
            ],
        },
    }


def engine_disruption_budget(m3d: M3Deployment) -> dict[str, Any]:
    return pods.pod_disruption_budget(m3d, ENGINE)
