"""What the autoscaler tells users: ``status.autoscaling``, the ``AutoscalingActive`` condition and
Events.  Pure: decisions and observations in, dictionaries and strings out."""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from m3stack.operator.autoscaler.algorithm import AutoscalerConfig, ClusterState, Decision, Mode, Reason
from m3stack.operator.render.names import ENGINE, child_name
from m3stack.operator.spec import M3Deployment
from m3stack.operator.status import AUTOSCALING_ACTIVE

BUILTIN, KEDA, HPA, NONE = "Builtin", "KEDA", "HPA", "None"
MAX_RECENT_DECISIONS = 5
# Condition reasons besides the algorithm's own.
SUSPENDED = "Suspended"
INVALID_CONFIGURATION = "InvalidConfiguration"
EXTERNAL_AUTOSCALER = "ExternalAutoscaler"
# Event reasons.
SCALED_UP, SCALED_DOWN, METRICS_UNAVAILABLE = "ScaledUp", "ScaledDown", "MetricsUnavailable"


@dataclass(frozen=True)
class ScaleChange:
    """One change of the engine count, as kept in status.autoscaling.recentDecisions."""

    time: str
    from_replicas: int
    to_replicas: int
    reason: str
    mode: Mode
    concurrency: float  # stable-window mean when decided

    def to_status(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "fromReplicas": self.from_replicas,
            "toReplicas": self.to_replicas,
            "reason": self.reason,
            "state": self.mode.value.capitalize(),
            "observedConcurrency": round(self.concurrency, 2),
        }


@dataclass(frozen=True)
class GatewayCoverage:
    """How many gateways were found and how many answered the last scrape (and why the others did not)."""

    targets: int
    answered: int
    failures: Mapping[str, str]

    def explain(self) -> str:
        if not self.targets:
            return "no gateway to read metrics from"
        problems = "; ".join(f"{url}: {why}" for url, why in sorted(self.failures.items())[:3])
        return f"{self.answered} of {self.targets} gateways answered" + (f" ({problems})" if problems else "")


def describe(decision: Decision, cluster: ClusterState, config: AutoscalerConfig, coverage: GatewayCoverage) -> str:
    """The AutoscalingActive message: what was seen, what was decided and why."""
    if decision.reason is Reason.NO_DATA:
        return f"holding {cluster.current_replicas} engines: no recent concurrency sample, {coverage.explain()}"
    seen = (
        f"{decision.stable_concurrency:.1f} requests in flight ({decision.panic_concurrency:.1f} over the panic "
        f"window) for a target of {config.target:g} per engine, {decision.mode.value} mode"
    )
    wanted = decision.desired_replicas
    details = {
        Reason.INSUFFICIENT_CAPACITY: f"{cluster.unschedulable_pods} engine pods cannot be scheduled: no scale-up "
        "until they are placed",
        Reason.PODS_PENDING: f"{cluster.pending_pods} engine pods are still pending: no scale-up until they run",
        Reason.MAX_REACHED: f"capped at maxReplicas {config.max_replicas}",
        Reason.SCALE_DOWN_DELAYED: f"scale-down delayed ({config.scale_down_delay_s:g} s)",
    }
    detail = details.get(decision.reason, "")
    return f"{wanted} engines for {seen}" + (f"; {detail}" if detail else "")


def stamp(condition: dict[str, Any], previous: Sequence[Mapping[str, Any]], now: str, generation: int) -> dict:
    """Adds lastTransitionTime (kept while the condition's status holds) and observedGeneration."""
    before = next((c for c in previous if c.get("type") == condition["type"]), None)
    unchanged = before is not None and before.get("status") == condition["status"]
    since = before.get("lastTransitionTime", now) if unchanged and before is not None else now
    return {**condition, "lastTransitionTime": since, "observedGeneration": generation}


def condition(active: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": AUTOSCALING_ACTIVE, "status": "True" if active else "False", "reason": reason, "message": message}


def builtin_status(
    decision: Decision,
    cluster: ClusterState,
    config: AutoscalerConfig,
    coverage: GatewayCoverage,
    recent: Iterable[ScaleChange],
) -> dict[str, Any]:
    """status.autoscaling and the (unstamped) condition of a Builtin decision."""
    recent = list(recent)[-MAX_RECENT_DECISIONS:]
    autoscaling: dict[str, Any] = {
        "mode": BUILTIN,
        "state": decision.mode.value.capitalize(),
        "reason": decision.reason.value,
        "desiredReplicas": decision.desired_replicas,
        "observedConcurrency": round(decision.stable_concurrency, 2),
        "panicConcurrency": round(decision.panic_concurrency, 2),
        "gatewayTargets": coverage.targets,
        "gatewaysScraped": coverage.answered,
        "recentDecisions": [change.to_status() for change in recent],
    }
    if recent:
        autoscaling["lastScaleTime"] = recent[-1].time
    active = decision.reason is not Reason.NO_DATA
    return {
        "autoscaling": autoscaling,
        "conditions": [condition(active, decision.reason.value, describe(decision, cluster, config, coverage))],
    }


def inactive_status(mode: str, reason: str, message: str) -> dict[str, Any]:
    """A Builtin autoscaler that does not decide (suspended, invalid settings)."""
    return {"autoscaling": {"mode": mode}, "conditions": [condition(False, reason, message)]}


def external_status(m3d: M3Deployment) -> dict[str, Any]:
    """KEDA or HPA: the rendered object drives /scale; the operator only says so."""
    scaling = m3d.spec.engine_autoscaling
    driver = "KEDA ScaledObject" if scaling.mode == KEDA else "HorizontalPodAutoscaler"
    message = (
        f"{driver} {child_name(m3d, ENGINE)} sets spec.engine.replicas through /scale "
        f"({scaling.min_replicas} to {scaling.max_replicas} engines)"
    )
    return {"autoscaling": {"mode": scaling.mode}, "conditions": [condition(True, EXTERNAL_AUTOSCALER, message)]}


def scale_event(change: ScaleChange, message: str) -> tuple[str, str]:
    """(reason, message) of the Normal event announcing a change of the engine count."""
    reason = SCALED_UP if change.to_replicas > change.from_replicas else SCALED_DOWN
    return reason, f"engines {change.from_replicas} -> {change.to_replicas}: {message}"
