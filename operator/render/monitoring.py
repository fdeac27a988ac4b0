"""A Prometheus Operator ServiceMonitor per M3Deployment: its gateways' and engines' /metrics.

Rendered only when the cluster serves ``monitoring.coreos.com/v1`` ServiceMonitors (the reconciler
checks; ``render_children`` gets ``Monitoring`` then).  One ServiceMonitor selects both Services of the
resource: the gateway Service's ``http`` port (m3stack_gateway_*, which the KEDA mode's query reads with
the ``namespace`` and ``service`` labels Prometheus gives its series) and the headless engine Service's
``metrics`` port (vLLM's metrics, m3stack_engine_*): one target per ready engine pod.
"""

from dataclasses import dataclass, field
from typing import Any

from m3stack.operator.render.engine import METRICS_PORT_NAME
from m3stack.operator.render.gateway import HTTP_PORT_NAME
from m3stack.operator.render.names import DEPLOYMENT_LABEL, MANAGED_BY_LABEL, OPERATOR_NAME, child_name, labels
from m3stack.operator.spec import M3Deployment

SERVICE_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
MONITORING = "monitoring"  # the ServiceMonitor's name suffix and component label


@dataclass(frozen=True)
class Monitoring:
    """How ServiceMonitors are rendered: ``labels`` so the Prometheus that should scrape them selects them
    (kube-prometheus-stack selects ``release: <its release>`` by default), and the scrape interval."""

    labels: dict[str, str] = field(default_factory=dict)
    interval: str = "15s"


def service_monitor(m3d: M3Deployment, monitoring: Monitoring) -> dict[str, Any]:
    selector = {DEPLOYMENT_LABEL: m3d.name, MANAGED_BY_LABEL: OPERATOR_NAME}
    endpoints = [
        {"port": port, "path": "/metrics", "scheme": "http", "interval": monitoring.interval}
        for port in (HTTP_PORT_NAME, METRICS_PORT_NAME)
    ]
    return {
        "apiVersion": SERVICE_MONITOR_API_VERSION,
        "kind": "ServiceMonitor",
        "metadata": {
            "name": child_name(m3d, MONITORING),
            "namespace": m3d.namespace,
            "labels": {**monitoring.labels, **labels(m3d, MONITORING)},
        },
        "spec": {
            "selector": {"matchLabels": selector},
            "namespaceSelector": {"matchNames": [m3d.namespace]},
            "endpoints": endpoints,
        },
    }
