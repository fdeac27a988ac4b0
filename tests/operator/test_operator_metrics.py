"""The operator's own metrics: the built-in autoscaler's decisions per M3Deployment."""

from m3stack.operator.metrics import OperatorMetrics

DECISIONS = "m3stack_operator_autoscaler_decisions_total"
DESIRED = "m3stack_operator_autoscaler_desired_replicas"
OBSERVED = "m3stack_operator_autoscaler_observed_concurrency"


def test_decisions_count_by_direction_and_mode_and_the_gauges_hold_the_last_one():
    metrics = OperatorMetrics("lease")
    key = ("models", "demo")
    metrics.record_decision(key, desired=3, current=1, mode="panic", observed_concurrency=21.5)
    metrics.record_decision(key, desired=3, current=3, mode="stable", observed_concurrency=12.0)
    metrics.record_decision(key, desired=2, current=3, mode="stable", observed_concurrency=7.25)
    metrics.record_decision(key, desired=2, current=3, mode="stable", observed_concurrency=6.5)

    def decisions(direction: str, mode: str) -> float | None:
        labels = {"namespace": "models", "name": "demo", "direction": direction, "mode": mode}
        return metrics.registry.get_sample_value(DECISIONS, labels)

    assert (decisions("up", "panic"), decisions("unchanged", "stable"), decisions("down", "stable")) == (1, 1, 2)
    assert decisions("up", "stable") is None
    labels = {"namespace": "models", "name": "demo"}
    assert metrics.registry.get_sample_value(DESIRED, labels) == 2
    assert metrics.registry.get_sample_value(OBSERVED, labels) == 6.5


def test_a_deleted_resource_loses_its_series_and_the_others_keep_theirs():
    metrics = OperatorMetrics("lease")
    metrics.record_decision(("models", "gone"), desired=1, current=2, mode="stable", observed_concurrency=1.0)
    metrics.record_decision(("models", "kept"), desired=4, current=2, mode="panic", observed_concurrency=30.0)
    metrics.forget(("models", "gone"))
    names = {
        (sample.name, sample.labels.get("name")) for family in metrics.registry.collect() for sample in family.samples
    }
    assert not any(name == "gone" for _, name in names)
    assert (DESIRED, "kept") in names and (OBSERVED, "kept") in names and (DECISIONS, "kept") in names
