"""The chart's Grafana dashboard: every query parses as PromQL, and every metric it reads is one that an
m3stack engine, gateway or operator exports (under the name Prometheus stores: counters with ``_total``,
histograms as ``_bucket``/``_sum``/``_count``)."""

import json
import re
from pathlib import Path

import promql_parser
import pytest
from prometheus_client import CollectorRegistry

from m3stack.engine.server.metrics import EngineMetrics
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.metrics import MODEL_NAME_LABEL
from m3stack.operator.metrics import OperatorMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "m3stack" / "files" / "dashboards" / "m3stack.json"
# Grafana's interval variables are not PromQL; these stand for them when parsing.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}
# Series that carry model_name: the engine's vLLM-named ones and every gateway series.
MODEL_SERIES_PREFIXES = ("vllm:", "m3stack_gateway_")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Every series name the three components can export, from their own registries."""
    registries: list[CollectorRegistry] = [
        EngineMetrics("m3", 4096).registry,
        GatewayMetrics("m3").registry,
        OperatorMetrics("m3stack-operator").registry,
    ]
    return {
        f"{family.name}{suffix}"
        for registry in registries
        for family in registry.collect()
        for suffix in _SUFFIXES[family.type]
    }


def queries(dashboard: dict) -> list[str]:
    panel_queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variable_queries = [
        variable["query"]["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"
    ]
    return panel_queries + variable_queries


def promql(query: str) -> str:
    """A panel query as PromQL: Grafana's interval variables replaced; label_values(selector, label) -> selector."""
    for variable, duration in GRAFANA_INTERVALS.items():
        query = query.replace(variable, duration)
    label_values = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
    return label_values.group(1) if label_values else query


def selectors(query: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(promql(query)), pre_visit=visit)
    return found


def selected_metrics(query: str) -> set[str]:
    return {selector.name for selector in selectors(query)}


def model_filter(selector: promql_parser.VectorSelector) -> str | None:
    """The value a selector matches ``model_name`` against, if it does."""
    for matcher in selector.matchers.matchers:
        if matcher.name == MODEL_NAME_LABEL:
            return matcher.value
    return None


def test_every_query_parses_and_reads_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    found = set()
    for query in queries(dashboard):
        metrics = selected_metrics(query)
        assert metrics, f"no metric in {query!r}"
        assert metrics <= exported, f"{sorted(metrics - exported)} in {query!r} are not exported"
        found |= metrics
    # The metrics are on the dashboard, by vLLM's names.
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
    ):
        assert name in found, name


def test_every_panel_on_a_models_series_follows_the_model_variable():
    """The engine's vLLM series and every gateway series carry model_name (tests/observability checks both on
    running processes), so a panel on them shows the models chosen at the top, engines and gateways alike."""
    dashboard = json.loads(DASHBOARD.read_text())
    panel_queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for query in panel_queries:
        for selector in selectors(query):
            if selector.name.startswith(MODEL_SERIES_PREFIXES):
                assert model_filter(selector) == "$model_name", f"{selector.name} in {query!r}"
    assert model_filter(selectors('m3stack_gateway_engine_retries_total{namespace=~"$namespace"}')[0]) is None


def test_a_metric_that_does_not_exist_is_caught():
    assert selected_metrics('sum(rate(vllm:no_such_metric_total{model_name=~"$model_name"}[$__rate_interval]))') == {
        "vllm:no_such_metric_total"
    }
    assert "vllm:no_such_metric_total" not in exported_names()
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(vllm:num_requests_running[5m])")  # unbalanced


def test_panels_do_not_overlap_and_ids_are_unique():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = [
        (panel["gridPos"]["x"] + dx, panel["gridPos"]["y"] + dy)
        for panel in panels
        for dx in range(panel["gridPos"]["w"])
        for dy in range(panel["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))
