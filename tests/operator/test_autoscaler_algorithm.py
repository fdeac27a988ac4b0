"""Table-driven tests of the built-in autoscaler's decision function (operator/autoscaler/algorithm.py)."""

import math
from dataclasses import dataclass, replace

import pytest

from m3stack.operator.autoscaler.algorithm import (
    AutoscalerConfig,
    AutoscalerState,
    ClusterState,
    Mode,
    Reason,
    decide,
    initial_state,
    observe,
)

TICK_S = 2.0
CONFIG = AutoscalerConfig(
    target_per_engine=10,
    utilization=1.0,
    min_replicas=1,
    max_replicas=10,
    stable_window_s=60,
    panic_window_s=6,
    scale_down_delay_s=30,
)


@dataclass
class Simulation:
    """Feeds a concurrency sample every tick and applies each decision; unschedulable and loading pods
    never get ready."""

    config: AutoscalerConfig = CONFIG
    replicas: int = 1
    unschedulable: int = 0
    loading: int = 0
    now: float = 0.0
    state: AutoscalerState | None = None

    def __post_init__(self) -> None:
        self.state = self.state or AutoscalerState()
        self.history: list[int] = []  # desired replicas per tick

    def run(self, concurrency: float, seconds: float):
        decision = None
        for _ in range(int(seconds / TICK_S)):
            self.now += TICK_S
            self.state = observe(self.state, self.now, concurrency, self.config)
            ready = self.replicas - self.unschedulable - self.loading
            cluster = ClusterState(self.replicas, ready, unschedulable_pods=self.unschedulable)
            decision, self.state = decide(self.config, self.state, self.now, cluster)
            self.replicas = decision.desired_replicas
            self.history.append(self.replicas)
        return decision


def test_no_samples_holds_current_count():
    decision, _ = decide(CONFIG, AutoscalerState(), 0.0, ClusterState(3, 3))
    assert (decision.desired_replicas, decision.reason) == (3, Reason.NO_DATA)


@pytest.mark.parametrize(
    ("concurrency", "expected"),
    [
        (0, 1),  # zero traffic: the minimum, not zero (scale-to-zero is off)
        (5, 1),
        (10, 1),
        (11, 2),
        (35, 4),
        (1000, 10),  # clamped to max
    ],
)
def test_steady_load_converges_to_ceil_of_concurrency_over_target(concurrency, expected):
    sim = Simulation()
    sim.run(concurrency, 600)
    assert sim.replicas == expected


def test_utilization_lowers_the_per_engine_target():
    sim = Simulation(
        config=AutoscalerConfig(
            target_per_engine=10,
            utilization=0.5,
            max_replicas=20,
            stable_window_s=60,
            panic_window_s=6,
            scale_down_delay_s=30,
        )
    )
    sim.run(35, 600)
    assert sim.replicas == math.ceil(35 / 5)


def test_burst_enters_panic_and_scales_within_the_panic_window():
    sim = Simulation(replicas=1)
    sim.run(5, 120)
    decision = sim.run(80, 6)  # one panic window of burst
    assert decision.mode is Mode.PANIC
    assert sim.replicas >= 2  # growing at most max_scale_up_rate x ready per decision
    sim.run(80, 30)
    assert sim.replicas == 8


def test_scale_up_is_rate_limited_by_ready_engines():
    sim = Simulation(replicas=2)
    decision = sim.run(200, TICK_S)
    assert decision.desired_replicas == math.ceil(CONFIG.max_scale_up_rate * 2)


def test_panic_never_scales_down_and_exits_after_a_stable_window():
    sim = Simulation(replicas=1)
    sim.run(80, 40)
    assert sim.replicas == 8
    decision = sim.run(15, 20)  # load falls during panic: hold
    assert decision.mode is Mode.PANIC and sim.replicas == 8
    decision = sim.run(15, CONFIG.stable_window_s + CONFIG.scale_down_delay_s + 4 * TICK_S)
    assert decision.mode is Mode.STABLE
    assert sim.replicas == 2


def test_scale_down_waits_for_the_delay_and_halves_at_most():
    sim = Simulation(replicas=1)
    sim.run(60, 200)
    assert sim.replicas == 6
    sim.run(0, CONFIG.scale_down_delay_s - 2 * TICK_S)
    assert sim.replicas == 6, "scaled down before the scale-down delay"
    sim.run(0, 200)
    assert sim.replicas == 1
    drops = [a / b for a, b in zip(sim.history, sim.history[1:], strict=False) if b < a]
    assert drops and max(drops) <= CONFIG.max_scale_down_rate


def test_flapping_load_does_not_flap_replicas():
    sim = Simulation(replicas=1)
    sim.run(30, 200)
    before = sim.replicas
    for _ in range(10):
        sim.run(45, 4)
        sim.run(15, 4)
    changes = sum(1 for a, b in zip(sim.history[-100:], sim.history[-99:], strict=False) if a != b)
    assert changes <= 2, f"replicas flapped {changes} times: {sim.history[-100:]}"
    assert sim.replicas >= before


def test_no_scale_up_while_pods_are_unschedulable():
    sim = Simulation(replicas=3, unschedulable=1)
    decision = sim.run(200, 60)
    assert sim.replicas == 3
    assert decision.reason is Reason.INSUFFICIENT_CAPACITY


def test_no_scale_up_while_pods_are_still_starting():
    cluster = ClusterState(current_replicas=3, ready_replicas=2, pending_pods=1)
    decision, _ = decide(CONFIG, observe(AutoscalerState(), 1.0, 100, CONFIG), 1.0, cluster)
    assert (decision.desired_replicas, decision.reason) == (3, Reason.PODS_PENDING)


def test_scale_down_is_allowed_while_pods_are_pending():
    state = AutoscalerState()
    for t in range(1, 40):
        state = observe(state, float(t), 0.0, CONFIG)
    decision, _ = decide(CONFIG, state, 40.0, ClusterState(4, 2, pending_pods=2))
    assert decision.desired_replicas < 4


def test_max_reached_is_reported():
    sim = Simulation(replicas=10)
    decision = sim.run(500, 10)
    assert (decision.desired_replicas, decision.reason) == (10, Reason.MAX_REACHED)


def test_engines_still_loading_are_not_removed_by_the_scale_up_limit():
    """3 engines of which 2 load for minutes and a demand of 3: keep 3.  Knative caps the count at
    rate x ready = 2; panic mode hides that only while the panic threshold is not above the rate."""
    config = replace(CONFIG, panic_threshold=4.0)
    sim = Simulation(config=config, replicas=3, loading=2)
    decision = sim.run(30, config.stable_window_s + 3 * config.scale_down_delay_s)
    assert decision.mode is Mode.STABLE
    assert set(sim.history) == {3}


def test_unschedulable_pods_are_reported_while_the_demand_is_already_met():
    state = observe(AutoscalerState(), 1.0, 30, CONFIG)
    decision, _ = decide(CONFIG, state, 1.0, ClusterState(current_replicas=3, ready_replicas=2, unschedulable_pods=1))
    assert (decision.desired_replicas, decision.reason) == (3, Reason.INSUFFICIENT_CAPACITY)


def test_a_restarted_autoscaler_waits_a_full_delay_before_scaling_down():
    sim = Simulation(replicas=6, state=initial_state(0.0, 6))
    sim.run(0, CONFIG.scale_down_delay_s - 2 * TICK_S)
    assert sim.replicas == 6, "scaled down on the first samples after a restart"
    sim.run(0, 4 * TICK_S)
    assert sim.replicas < 6


def test_scale_to_zero_with_min_replicas_zero():
    zero = AutoscalerConfig(
        min_replicas=0,
        stable_window_s=60,
        panic_window_s=6,
        scale_down_delay_s=0,
        target_per_engine=10,
        utilization=1.0,
    )
    sim = Simulation(config=zero, replicas=2)
    sim.run(0, 200)
    assert sim.replicas == 0
    decision = sim.run(3, TICK_S)  # any demand wakes it
    assert decision.desired_replicas == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"target_per_engine": 0},
        {"utilization": 1.5},
        {"min_replicas": -1},
        {"min_replicas": 5, "max_replicas": 2},
        {"panic_window_s": 300, "stable_window_s": 60},
        {"panic_threshold": 1.0},
        {"max_scale_up_rate": 1.0},
        {"scale_down_delay_s": -1},
    ],
)
def test_invalid_config_is_refused(bad):
    with pytest.raises(ValueError):
        AutoscalerConfig(**bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_invalid_samples_are_refused(bad):
    with pytest.raises(ValueError, match="concurrency"):
        observe(AutoscalerState(), 0.0, bad, CONFIG)
