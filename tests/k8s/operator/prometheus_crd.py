"""The Prometheus Operator's ServiceMonitor CRD (``monitoring.coreos.com/v1``), reduced, for the test control plane.

Written for these tests after the Prometheus Operator's published CRD
(``example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml``): the spec fields a
ServiceMonitor's selection and endpoints are made of, with their types, required fields, the scheme enum
and the duration pattern, without the descriptions; fields m3stack does not set (TLS, authorization,
relabelings) are declared free-form.  With it installed the API server checks what the operator applies
(server-side apply refuses undeclared fields) and the operator sees the API served.
"""

from __future__ import annotations

from typing import Any

# The Prometheus Operator's Duration pattern.
DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRING = {"type": "string"}
FREE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
FREE_LIST = {"type": "array", "items": FREE}
LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": STRING},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"key": STRING, "operator": STRING, "values": {"type": "array", "items": STRING}},
                "required": ["key", "operator"],
            },
        },
    },
    "x-kubernetes-map-type": "atomic",
}
ENDPOINT = {
    "type": "object",
    "properties": {
        "port": STRING,
        "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
        "path": STRING,
        "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {"type": "object", "additionalProperties": {"type": "array", "items": STRING}},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "relabelings": FREE_LIST,
        "metricRelabelings": FREE_LIST,
        "tlsConfig": FREE,
        "authorization": FREE,
        "bearerTokenSecret": FREE,
    },
}
SPEC = {
    "type": "object",
    "properties": {
        "endpoints": {"type": "array", "items": ENDPOINT},
        "selector": LABEL_SELECTOR,
        "namespaceSelector": {
            "type": "object",
            "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": STRING}},
        },
        "jobLabel": STRING,
        "targetLabels": {"type": "array", "items": STRING},
        "podTargetLabels": {"type": "array", "items": STRING},
        "sampleLimit": {"type": "integer", "format": "int64"},
        "attachMetadata": FREE,
    },
    "required": ["selector"],
}


def service_monitor_crd() -> dict[str, Any]:
    root = {
        "type": "object",
        "properties": {"apiVersion": STRING, "kind": STRING, "metadata": {"type": "object"}, "spec": SPEC},
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {
                "kind": "ServiceMonitor",
                "listKind": "ServiceMonitorList",
                "plural": "servicemonitors",
                "singular": "servicemonitor",
                "shortNames": ["smon"],
                "categories": ["prometheus-operator"],
            },
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": root}}],
        },
    }
