"""Desired engine replicas from observed concurrency: Knative KPA math with GPU-appropriate defaults.

Pure and deterministic: ``observe`` records a sample, ``decide`` turns the samples, the config and the
cluster's state into a ``Decision`` plus the next state.  Nothing here reads a clock or the API.

    target        = target_per_engine * utilization
    stable, panic = mean concurrency over the stable / panic window
    ready         = max(1, ready engines)
    max_up        = max(ceil(max_scale_up_rate * ready), current);  max_down = floor(ready / max_scale_down_rate)
    stable_pods   = clamp(ceil(stable / target), max_down, max_up)   (likewise panic_pods)
    panic         when ceil(panic / target) / ready >= panic_threshold; left after a full stable window
                  below the threshold; while in panic the desired count never decreases
    scale down    only to the highest recommendation of the last scale_down_delay seconds
    never up      while engine pods are Pending (InsufficientCapacity when unschedulable)
    min_replicas  0 allows scaling to zero (off by default: the CRD's minReplicas defaults to 1)

Defaults follow AIBrix (stable 180 s, panic 60 s, rates 2x, scale-down delay 300 s): GPU engines take
minutes to load, so Knative's 60 s / 6 s windows would flap.

One departure from Knative: the scale-up limit is never below the current count.  Knative bounds the
desired count by ``rate * ready``, so while engines are still loading (minutes on GPUs, ready well
below current) it would remove the very engines that are about to serve the load.
"""

import math
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum


class Mode(StrEnum):
    STABLE = "stable"
    PANIC = "panic"


class Reason(StrEnum):
    NO_DATA = "NoMetrics"  # no concurrency sample yet: hold the current count
    SCALED = "Scaled"
    STEADY = "Steady"
    SCALE_DOWN_DELAYED = "ScaleDownDelayed"
    MAX_REACHED = "MaxReplicasReached"
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # pods unschedulable: no scale-up
    PODS_PENDING = "PodsPending"  # pods still starting: no scale-up until they run


@dataclass(frozen=True)
class AutoscalerConfig:
    target_per_engine: float = 8.0  # concurrent requests one engine is meant to hold
    utilization: float = 0.7
    min_replicas: int = 1
    max_replicas: int = 8
    stable_window_s: float = 180.0
    panic_window_s: float = 60.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 2.0
    max_scale_down_rate: float = 2.0
    scale_down_delay_s: float = 300.0

    def __post_init__(self) -> None:
        problems = []
        if self.target_per_engine <= 0:
            problems.append("target_per_engine must be > 0")
        if not 0 < self.utilization <= 1:
            problems.append("utilization must be in (0, 1]")
        if self.min_replicas < 0:
            problems.append("min_replicas must be >= 0")
        if self.max_replicas < max(1, self.min_replicas):
            problems.append("max_replicas must be >= max(1, min_replicas)")
        if not 0 < self.panic_window_s <= self.stable_window_s:
            problems.append("panic window must be in (0, stable window]")
        if self.panic_threshold <= 1:
            problems.append("panic_threshold must be > 1")
        if self.max_scale_up_rate <= 1 or self.max_scale_down_rate <= 1:
            problems.append("max scale rates must be > 1")
        if self.scale_down_delay_s < 0:
            problems.append("scale_down_delay_s must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def target(self) -> float:
        return self.target_per_engine * self.utilization


@dataclass(frozen=True)
class ClusterState:
    """What the engine Deployment looks like right now."""

    current_replicas: int  # spec.engine.replicas as last written
    ready_replicas: int
    pending_pods: int = 0  # created but not running yet (scheduled or not)
    unschedulable_pods: int = 0  # PodScheduled=False, reason Unschedulable


@dataclass(frozen=True)
class Decision:
    desired_replicas: int
    mode: Mode
    reason: Reason
    stable_concurrency: float
    panic_concurrency: float


@dataclass
class AutoscalerState:
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, concurrency)
    panic_since: float | None = None  # last time the panic threshold was exceeded, while in panic
    max_panic_pods: int = 0
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)  # (time, desired) for the delay

    def copy(self) -> "AutoscalerState":
        return replace(self, samples=deque(self.samples), recommendations=deque(self.recommendations))


def initial_state(now: float, current_replicas: int) -> AutoscalerState:
    """The state of an autoscaler that starts (or restarts) on a running deployment: the current
    count counts as a recommendation, so nothing is removed before a full scale-down delay of data."""
    return AutoscalerState(recommendations=deque([(now, current_replicas)]))


def observe(state: AutoscalerState, now: float, concurrency: float, config: AutoscalerConfig) -> AutoscalerState:
    """Add a concurrency sample and drop samples older than the stable window."""
    if concurrency < 0 or not math.isfinite(concurrency):
        raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency}")
    new = state.copy()
    new.samples.append((now, concurrency))
    while new.samples and new.samples[0][0] <= now - config.stable_window_s:
        new.samples.popleft()
    return new


def _window_mean(samples: deque[tuple[float, float]], now: float, window_s: float) -> float | None:
    values = [value for time, value in samples if time > now - window_s]
    return sum(values) / len(values) if values else None


def decide(
    config: AutoscalerConfig, state: AutoscalerState, now: float, cluster: ClusterState
) -> tuple[Decision, AutoscalerState]:
    stable = _window_mean(state.samples, now, config.stable_window_s)
    panic = _window_mean(state.samples, now, config.panic_window_s)
    if stable is None or panic is None:
        hold = Decision(cluster.current_replicas, Mode.STABLE, Reason.NO_DATA, 0.0, 0.0)
        return hold, state.copy()

    new = state.copy()
    ready = max(1, cluster.ready_replicas)
    # The rate limits growth; it must not shrink a count that ready engines have not caught up with.
    max_up = max(math.ceil(config.max_scale_up_rate * ready), cluster.current_replicas)
    max_down = math.floor(ready / config.max_scale_down_rate)
    wanted_stable = math.ceil(stable / config.target)
    wanted_panic = math.ceil(panic / config.target)
    stable_pods = min(max(wanted_stable, max_down), max_up)
    panic_pods = min(max(wanted_panic, max_down), max_up)

    over_threshold = wanted_panic / ready >= config.panic_threshold
    if over_threshold:
        new.panic_since = now
    elif new.panic_since is not None and now - new.panic_since >= config.stable_window_s:
        new.panic_since = None
        new.max_panic_pods = 0

    if new.panic_since is not None:
        mode = Mode.PANIC
        desired = max(stable_pods, panic_pods, new.max_panic_pods, cluster.current_replicas)
        new.max_panic_pods = desired
    else:
        mode = Mode.STABLE
        desired = stable_pods

    # Scale down only to the highest recommendation within the delay window.
    new.recommendations.append((now, desired))
    while new.recommendations and new.recommendations[0][0] < now - config.scale_down_delay_s:
        new.recommendations.popleft()
    delayed = max(value for _, value in new.recommendations)
    reason = Reason.SCALE_DOWN_DELAYED if delayed > desired else None
    desired = delayed

    if desired > config.max_replicas:
        desired, reason = config.max_replicas, Reason.MAX_REACHED
    desired = max(desired, config.min_replicas)

    # Adding engines while earlier ones cannot even be placed only piles up Pending pods.  Wanting at
    # least what exists while some of it cannot be placed is reported as such, even with nothing to add.
    if cluster.unschedulable_pods and desired >= cluster.current_replicas:
        desired, reason = cluster.current_replicas, Reason.INSUFFICIENT_CAPACITY
    elif cluster.pending_pods and desired > cluster.current_replicas:
        desired, reason = cluster.current_replicas, Reason.PODS_PENDING

    if reason is None:
        reason = Reason.STEADY if desired == cluster.current_replicas else Reason.SCALED
    return Decision(desired, mode, reason, stable, panic), new
