"""Status from what is observed: the children's Deployments and pods in, ``.status`` and transitions out.

Pure: the caller passes the observed objects, the previous status and the time.  Conditions keep
their lastTransitionTime while their status stays; a change of status (or of Degraded's reason) is
a ``Transition`` the caller turns into an Event.

The result holds only what this module owns, and the caller server-side applies it to the status
subresource: other writers (the engine autoscaler: ``status.autoscaling`` and the
``AutoscalingActive`` condition while a mode is set) keep their fields and conditions untouched.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from m3stack.operator.fits import FITS, assess_fit
from m3stack.operator.render.names import (
    COMPONENT_LABEL,
    ENGINE,
    GATEWAY,
    gateway_url,
    selector_string,
)
from m3stack.operator.spec import M3Deployment

# Condition types.
READY = "Ready"
GATEWAY_READY = "GatewayReady"
ENGINES_READY = "EnginesReady"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
AUTOSCALING_ACTIVE = "AutoscalingActive"

# Reasons.
ALL_REPLICAS_READY = "AllReplicasReady"
ALL_COMPONENTS_READY = "AllComponentsReady"
PARTIALLY_READY = "PartiallyReady"
NOT_CREATED = "NotCreated"
SUSPENDED = "Suspended"
SCALED_TO_ZERO = "ScaledToZero"
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
IMAGE_PULL_BACK_OFF = "ImagePullBackOff"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
CONFIG_ERROR = "CreateContainerConfigError"
MODEL_LOADING = "ModelLoading"
UPDATING = "Updating"
REPLICAS_NOT_READY = "ReplicasNotReady"
WAITING_FOR_ENGINES = "WaitingForEngines"
ROLLOUT_COMPLETE = "RolloutComplete"
RECONCILE_FAILED = "ReconcileFailed"
AS_EXPECTED = "AsExpected"
AUTOSCALING_DISABLED = "Disabled"

# Problems that waiting will not fix, most telling first: they make the resource Degraded.
PERSISTENT_PROBLEMS = (INSUFFICIENT_CAPACITY, IMAGE_PULL_BACK_OFF, CRASH_LOOP_BACK_OFF, CONFIG_ERROR)
_WAITING_REASONS = {
    "ImagePullBackOff": IMAGE_PULL_BACK_OFF,
    "ErrImagePull": IMAGE_PULL_BACK_OFF,
    "InvalidImageName": IMAGE_PULL_BACK_OFF,
    "CrashLoopBackOff": CRASH_LOOP_BACK_OFF,
    "CreateContainerConfigError": CONFIG_ERROR,
}
# Conditions whose changes become Events (the others change with every rollout); Fits also when it starts False.
EVENT_CONDITIONS = (READY, DEGRADED, FITS)
OWNED_CONDITIONS = (READY, GATEWAY_READY, ENGINES_READY, PROGRESSING, DEGRADED, FITS)


@dataclass(frozen=True)
class Observed:
    """What the caller read from the cluster for one M3Deployment."""

    deployments: Mapping[str, Mapping[str, Any]]  # component -> Deployment (absent: not created yet)
    pods: Sequence[Mapping[str, Any]] = ()  # the resource's pods; may be empty when all are ready
    reconcile_error: str | None = None  # why applying the children failed, if it did


@dataclass(frozen=True)
class ComponentHealth:
    ready: bool  # every desired replica is ready
    serving: bool  # at least one replica is ready (and some are wanted): requests get answered
    rolled_out: bool
    reason: str
    message: str
    counts: dict[str, int]


@dataclass(frozen=True)
class Transition:
    """A condition that changed: becomes an Event (Normal when healthy, Warning otherwise)."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def healthy(self) -> bool:
        return (self.status == "True") != (self.type == DEGRADED)


def needs_pods(m3d: M3Deployment, deployments: Mapping[str, Mapping[str, Any]]) -> bool:
    """Pods explain why a component is not ready: worth reading only for a Deployment that is not
    ready and that its controller has seen (before that it has no pods to explain anything)."""
    for component in (ENGINE, GATEWAY):
        deployment = deployments.get(component)
        if deployment is None:
            continue
        seen = int(deployment.get("status", {}).get("observedGeneration", 0)) >= int(
            deployment.get("metadata", {}).get("generation", 0)
        )
        if seen and not assess_component(component, deployment, (), suspended=m3d.spec.suspend).ready:
            return True
    return False


def assess_component(
    component: str,
    deployment: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    *,
    suspended: bool,
) -> ComponentHealth:
    if deployment is None:
        return ComponentHealth(False, False, False, NOT_CREATED, f"the {component} Deployment does not exist yet", {})
    status = deployment.get("status", {})
    desired = int(deployment.get("spec", {}).get("replicas", 1))
    counts = {
        "replicas": int(status.get("replicas", 0)),
        "readyReplicas": int(status.get("readyReplicas", 0)),
        "updatedReplicas": int(status.get("updatedReplicas", 0)),
        "availableReplicas": int(status.get("availableReplicas", 0)),
    }
    rolled_out = (
        int(status.get("observedGeneration", 0)) >= int(deployment.get("metadata", {}).get("generation", 0))
        and counts["updatedReplicas"] >= desired
        and counts["replicas"] <= desired
    )
    progress = f"{counts['readyReplicas']}/{desired} ready, {counts['updatedReplicas']} updated"
    if suspended:
        return ComponentHealth(False, False, rolled_out, SUSPENDED, "spec.suspend is true", counts)
    if desired == 0:
        return ComponentHealth(False, False, rolled_out, SCALED_TO_ZERO, f"the {component} has 0 replicas", counts)
    if counts["readyReplicas"] >= desired:
        return ComponentHealth(True, True, rolled_out, ALL_REPLICAS_READY, progress, counts)
    serving = counts["readyReplicas"] > 0
    component_pods = [
        pod for pod in pods if pod.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL) == component
    ]
    problem = _worst_problem(component_pods, model_loads=component == ENGINE)
    if problem is not None:
        reason, detail = problem
        return ComponentHealth(False, serving, rolled_out, reason, f"{progress}: {detail}", counts)
    reason = REPLICAS_NOT_READY if rolled_out else UPDATING
    return ComponentHealth(False, serving, rolled_out, reason, progress, counts)


def pod_problem(pod: Mapping[str, Any], *, model_loads: bool) -> tuple[str, str] | None:
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status", {})
    for condition in status.get("conditions", []):
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return INSUFFICIENT_CAPACITY, f"pod {name} cannot be scheduled: {condition.get('message', '')}".strip()
    containers = [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
    for container in containers:
        waiting = container.get("state", {}).get("waiting") or {}
        reason = _WAITING_REASONS.get(waiting.get("reason", ""))
        if reason == CRASH_LOOP_BACK_OFF and container.get("lastState", {}).get("terminated"):
            return reason, f"pod {name}: {_last_exit(container)}"
        if reason is not None:
            return reason, f"pod {name}: {waiting.get('reason')}: {waiting.get('message', '')}".rstrip(": ")
    loading = any("running" in c.get("state", {}) and not c.get("started", False) for c in containers)
    if model_loads and status.get("phase") == "Running" and loading:
        return MODEL_LOADING, f"pod {name} is loading the model"
    return None


def _last_exit(container: Mapping[str, Any]) -> str:
    """Why a crash-looping container last stopped: its exit code and kubelet reason (OOMKilled), then the last
    line of its termination message, which the pods' FallbackToLogsOnError fills with the log's tail: the error
    the process printed before exiting (the kubelet's own message only says how long it backs off)."""
    terminated = container["lastState"]["terminated"]
    reason = terminated.get("reason", "")
    detail = f"container {container.get('name', '?')} exited with code {terminated.get('exitCode', '?')}"
    if reason and reason != "Error":
        detail += f", {reason}"
    detail += f" (restarted {container.get('restartCount', 0)} times)"
    lines = [line.strip() for line in str(terminated.get("message", "")).splitlines() if line.strip()]
    if lines:
        last = lines[-1] if len(lines[-1]) <= _EXIT_LINE_CHARS else lines[-1][: _EXIT_LINE_CHARS - 1] + "\u2026"
        detail += f": {last}"
    return detail


_EXIT_LINE_CHARS = 500  # a condition message stays readable in `kubectl describe`


def _worst_problem(pods: Iterable[Mapping[str, Any]], *, model_loads: bool) -> tuple[str, str] | None:
    ranking = [*PERSISTENT_PROBLEMS, MODEL_LOADING]
    problems = [
        problem
        for pod in pods
        if not pod.get("metadata", {}).get("deletionTimestamp")
        and (problem := pod_problem(pod, model_loads=model_loads)) is not None
    ]
    return min(problems, key=lambda problem: ranking.index(problem[0]), default=None)


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _autoscaling_condition(m3d: M3Deployment) -> list[dict[str, str]]:
    """AutoscalingActive=False/Disabled while no mode is set; with a mode the autoscaler writes it."""
    if m3d.spec.engine_autoscaling.mode != "None":
        return []
    return [_condition(AUTOSCALING_ACTIVE, False, AUTOSCALING_DISABLED, "autoscaling.engine.mode is None")]


def _owned(condition: Mapping[str, Any]) -> bool:
    """Whether this module wrote the condition (AutoscalingActive only in its Disabled form)."""
    if condition.get("type") == AUTOSCALING_ACTIVE:
        return condition.get("reason") == AUTOSCALING_DISABLED
    return condition.get("type") in OWNED_CONDITIONS


def _component_status(m3d: M3Deployment, component: str, health: ComponentHealth) -> dict[str, Any]:
    return {**{key: health.counts.get(key, 0) for key in _COUNT_KEYS}, "selector": selector_string(m3d, component)}


_COUNT_KEYS = ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas")


def compute_status(
    m3d: M3Deployment,
    observed: Observed,
    previous: Mapping[str, Any],
    *,
    observed_generation: int,
    now: str,
) -> tuple[dict[str, Any], list[Transition]]:
    """The new ``.status`` (only the keys this module owns) and the condition transitions since ``previous``."""
    suspended = m3d.spec.suspend
    engines = assess_component(ENGINE, observed.deployments.get(ENGINE), observed.pods, suspended=suspended)
    gateways = _waiting_for_engines(
        assess_component(GATEWAY, observed.deployments.get(GATEWAY), observed.pods, suspended=suspended), engines
    )
    ready_condition = _ready_condition(engines, gateways)
    serving = ready_condition["status"] == "True"
    rolled_out = engines.rolled_out and gateways.rolled_out and observed_generation >= m3d.generation
    progressing = _condition(
        PROGRESSING,
        not rolled_out,
        UPDATING if not rolled_out else ROLLOUT_COMPLETE,
        f"engines: {engines.message}; gateways: {gateways.message}",
    )
    degraded = _degraded(observed.reconcile_error, engines, gateways)
    fit = assess_fit(m3d)
    previous_conditions = {c["type"]: c for c in previous.get("conditions", []) if "type" in c}
    fresh = [
        ready_condition,
        _condition(ENGINES_READY, engines.ready, engines.reason, engines.message),
        _condition(GATEWAY_READY, gateways.ready, gateways.reason, gateways.message),
        progressing,
        degraded,
        {"type": FITS, "status": fit.status, "reason": fit.reason, "message": fit.message},
        *_autoscaling_condition(m3d),
    ]
    conditions, transitions = _stamp(fresh, previous_conditions, observed_generation, now)
    status = {
        "observedGeneration": observed_generation,
        "phase": _phase(suspended, serving, degraded["status"] == "True", engines, gateways),
        "url": gateway_url(m3d),
        "conditions": conditions,
        "engine": _component_status(m3d, ENGINE, engines),
        "gateway": _component_status(m3d, GATEWAY, gateways),
    }
    return status, transitions


def _ready_condition(engines: ComponentHealth, gateways: ComponentHealth) -> dict[str, str]:
    """Ready means the resource serves: a ready engine behind a ready gateway.  A scale-up (by hand or by the
    engine autoscaler, which scales all the time) leaves it True while the new replicas load, as a Knative
    Service stays Ready while it scales: EnginesReady, GatewayReady and Progressing tell the rest."""
    if engines.ready and gateways.ready:
        return _condition(READY, True, ALL_COMPONENTS_READY, "engines and gateways are ready")
    if engines.serving and gateways.serving:
        message = f"engines {engines.message}; gateways {gateways.message}"
        return _condition(READY, True, PARTIALLY_READY, f"serving, not every replica ready: {message}")
    blocking, which = (engines, "engines") if not engines.serving else (gateways, "gateways")
    return _condition(READY, False, blocking.reason, f"{which}: {blocking.message}")


def _waiting_for_engines(gateways: ComponentHealth, engines: ComponentHealth) -> ComponentHealth:
    """Gateways with no visible problem that are not ready while no engine is: their /ready waits for an engine
    to route to, and saying so points at the engines rather than at the gateways."""
    if gateways.reason not in (REPLICAS_NOT_READY, UPDATING) or engines.counts.get("readyReplicas", 0) > 0:
        return gateways
    message = f"{gateways.message}: a gateway is ready once an engine is, and no engine is ready"
    return replace(gateways, reason=WAITING_FOR_ENGINES, message=message)


def _degraded(reconcile_error: str | None, *components: ComponentHealth) -> dict[str, str]:
    if reconcile_error:
        return _condition(DEGRADED, True, RECONCILE_FAILED, reconcile_error)
    for reason in PERSISTENT_PROBLEMS:
        for health in components:
            if health.reason == reason:
                return _condition(DEGRADED, True, reason, health.message)
    return _condition(DEGRADED, False, AS_EXPECTED, "no persistent problem seen")


def _phase(suspended: bool, serving: bool, degraded: bool, *components: ComponentHealth) -> str:
    """Suspended, then Degraded (a persistent problem, even while serving), then Ready (serving, as the Ready
    condition: replicas may still be loading), then Progressing or Pending."""
    if suspended:
        return "Suspended"
    if degraded:
        return "Degraded"
    if serving:
        return "Ready"
    # Pods exist (starting, loading the model, rolling): on the way; none at all: not started yet.
    return "Progressing" if any(health.counts.get("replicas", 0) for health in components) else "Pending"


def _stamp(
    fresh: list[dict[str, Any]],
    previous: Mapping[str, Mapping[str, Any]],
    observed_generation: int,
    now: str,
) -> tuple[list[dict[str, Any]], list[Transition]]:
    """Adds lastTransitionTime (kept while the status holds) and observedGeneration; lists what changed."""
    conditions, transitions = [], []
    for condition in fresh:
        before = previous.get(condition["type"])
        changed = before is None or before.get("status") != condition["status"]
        if condition["type"] == DEGRADED and before is not None and condition["status"] == "True":
            changed = changed or before.get("reason") != condition["reason"]
        stamped = {
            **condition,
            "lastTransitionTime": now
            if before is None or before.get("status") != condition["status"]
            else before.get("lastTransitionTime", now),
            "observedGeneration": observed_generation,
        }
        conditions.append(stamped)
        first_news = condition["status"] == ("False" if condition["type"] == FITS else "True")
        if changed and condition["type"] in EVENT_CONDITIONS and (before is not None or first_news):
            transitions.append(
                Transition(condition["type"], condition["status"], condition["reason"], condition["message"])
            )
    return conditions, transitions


def status_changed(new: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether applying ``new`` would change ``current`` (ignoring what other writers own)."""
    if any(current.get(key) != value for key, value in new.items() if key != "conditions"):
        return True
    ours = [condition for condition in current.get("conditions", []) if _owned(condition)]
    return sorted(ours, key=_by_type) != sorted(new.get("conditions", []), key=_by_type)


def _by_type(condition: Mapping[str, Any]) -> str:
    return str(condition.get("type"))
