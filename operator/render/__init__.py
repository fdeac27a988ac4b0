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
from m3stack.operator.render.gateway import (
    gateway_autoscaler,
    gateway_deployment,
    gateway_disruption_budget,
    gateway_service,
)
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
SCALED_OBJECT = ChildKind("keda.sh/v1alpha1", "ScaledObject")
ALL_CHILD_KINDS = (
    CONFIG_MAP,
    SERVICE,
    DEPLOYMENT,
    POD_DISRUPTION_BUDGET,
    HORIZONTAL_POD_AUTOSCALER,
    INGRESS,
    SCALED_OBJECT,
)
# Kinds whose CRD may not be installed (KEDA's): not watched, and a cluster without them holds none.
OPTIONAL_CHILD_KINDS = (SCALED_OBJECT,)
# Kinds a resource may own more than one of (the gateway's and the engines' HPA): pruned by name.
SHARED_CHILD_KINDS = (HORIZONTAL_POD_AUTOSCALER,)


def kind_of(manifest: Manifest) -> ChildKind:
    return ChildKind(manifest["apiVersion"], manifest["kind"])


def render_children(m3d: M3Deployment, images: Images) -> list[Manifest]:
    """Every child the resource wants, configuration first so pods never start without it."""
    spec = m3d.spec
    children = [
        config_map(m3d),
        engine_service(m3d),
        gateway_service(m3d),
        engine_deployment(m3d, spec.engine.image or images.engine, config_hash(engine_environment(m3d))),
        gateway_deployment(m3d, spec.gateway.image or images.gateway, config_hash(gateway_environment(m3d))),
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
    return children
