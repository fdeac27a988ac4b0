"""Pure rendering: an M3Deployment in, the manifests of its children out (no I/O, no clock).

``render_children`` returns every child the resource should have right now, in apply order;
``ALL_CHILD_KINDS`` lists every kind it can ever return, so the operator knows what to watch, what
to prune when a child stops being wanted, and what RBAC it needs.
"""

from dataclasses import dataclass
from typing import Any

from m3stack.operator.render.autoscaling import engine_autoscaler, engine_scaled_object
from m3stack.operator.render.config import config_hash, config_map, engine_environment, gateway_environment
from m3stack.operator.render.engine import engine_deployment, engine_disruption_budget, engine_service
from m3stack.operator.render.exposure import ingress
from m3stack.operator.render.flags import GATEWAYS_OWN_DEFAULTS, GatewayDefaults
from m3stack.operator.render.gateway import (
    gateway_autoscaler,
    gateway_deployment,
    gateway_disruption_budget,
    gateway_service,
)
from m3stack.operator.render.monitoring import SERVICE_MONITOR_API_VERSION, Monitoring, service_monitor
from m3stack.operator.render.multinode import (
    LWS_API_VERSION,
    LWS_KIND,
    engine_leader_worker_set,
    is_multi_node,
    leaders_only,
)
from m3stack.operator.render.network import engine_network_policy
from m3stack.operator.spec import M3Deployment

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Images:
    """The operator's default images, for resources that do not name their own."""

    engine: str
    gateway: str


@dataclass(frozen=True, order=True)
class ChildKind:
    api_version: str
    kind: str


CONFIG_MAP = ChildKind("v1", "ConfigMap")
SERVICE = ChildKind("v1", "Service")
DEPLOYMENT = ChildKind("apps/v1", "Deployment")
POD_DISRUPTION_BUDGET = ChildKind("policy/v1", "PodDisruptionBudget")
HORIZONTAL_POD_AUTOSCALER = ChildKind("autoscaling/v2", "HorizontalPodAutoscaler")
INGRESS = ChildKind("networking.k8s.io/v1", "Ingress")
NETWORK_POLICY = ChildKind("networking.k8s.io/v1", "NetworkPolicy")
SCALED_OBJECT = ChildKind("keda.sh/v1alpha1", "ScaledObject")
LEADER_WORKER_SET = ChildKind(LWS_API_VERSION, LWS_KIND)
SERVICE_MONITOR = ChildKind(SERVICE_MONITOR_API_VERSION, "ServiceMonitor")
ALL_CHILD_KINDS = (
    CONFIG_MAP,
    SERVICE,
    DEPLOYMENT,
    POD_DISRUPTION_BUDGET,
    HORIZONTAL_POD_AUTOSCALER,
    INGRESS,
    NETWORK_POLICY,
    SCALED_OBJECT,
    LEADER_WORKER_SET,
    SERVICE_MONITOR,
)
# Kinds whose CRD may not be installed (KEDA's, LeaderWorkerSet's, the Prometheus Operator's): not watched, and a
# cluster without them holds none.
OPTIONAL_CHILD_KINDS = (SCALED_OBJECT, LEADER_WORKER_SET, SERVICE_MONITOR)
# Kinds a resource may own more than one of (the gateway's and the engines' HPA; the gateway's and, on one
# node, the engines' Deployment): pruned by name.
SHARED_CHILD_KINDS = (HORIZONTAL_POD_AUTOSCALER, DEPLOYMENT)
# The engine tier's workload: a Deployment, or a LeaderWorkerSet when multiNode.size > 1.
WORKLOAD_KINDS = (DEPLOYMENT, LEADER_WORKER_SET)


def kind_of(manifest: Manifest) -> ChildKind:
    return ChildKind(manifest["apiVersion"], manifest["kind"])


def render_children(
    m3d: M3Deployment,
    images: Images,
    monitoring: Monitoring | None = None,
    gateway_defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS,
) -> list[Manifest]:
    """Every child the resource wants, configuration first so pods never start without it; ``monitoring``: a
    ServiceMonitor too (given when the cluster serves them); ``gateway_defaults``: the operator's values for
    the gateway settings the resource leaves unset."""
    spec = m3d.spec
    engine_image, engine_hash = spec.engine.image or images.engine, config_hash(engine_environment(m3d))
    gateway_hash = config_hash(gateway_environment(m3d, gateway_defaults))
    multi_node = is_multi_node(m3d)
    children = [
        config_map(m3d, gateway_defaults),
        leaders_only(engine_service(m3d)) if multi_node else engine_service(m3d),
        gateway_service(m3d),
        engine_leader_worker_set(m3d, engine_image, engine_hash)
        if multi_node
        else engine_deployment(m3d, engine_image, engine_hash),
        gateway_deployment(m3d, spec.gateway.image or images.gateway, gateway_hash),
        engine_disruption_budget(m3d),
        gateway_disruption_budget(m3d),
    ]
    if spec.gateway_autoscaling.enabled and not spec.suspend:
        children.append(gateway_autoscaler(m3d))
    if spec.engine_autoscaling.mode == "KEDA" and not spec.suspend:
        children.append(engine_scaled_object(m3d))
    if spec.engine_autoscaling.mode == "HPA" and not spec.suspend:
        children.append(engine_autoscaler(m3d))
    if spec.exposure.ingress is not None:
        children.append(ingress(m3d, spec.exposure.ingress))
    if spec.engine.network_policy:
        children.append(engine_network_policy(m3d))
    if monitoring is not None:
        children.append(service_monitor(m3d, monitoring))
    return children
