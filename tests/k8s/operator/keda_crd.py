"""KEDA's ScaledObject CRD (``keda.sh/v1alpha1``), reduced to its spec schema, for the test control plane.

Written for these tests after KEDA 2.x's published CRD (``config/crd/bases/keda.sh_scaledobjects.yaml``):
every spec field KEDA defines, with its type and required fields, without the descriptions; the status
is left free-form.  With it installed, the API server checks the ScaledObjects the operator applies
(server-side apply refuses fields the schema does not declare), and creating and pruning them runs
against a real resource.
"""

from __future__ import annotations

from typing import Any

from m3stack.operator.schema import QUANTITY_PATTERN

INT32 = {"type": "integer", "format": "int32"}
STRING = {"type": "string"}
QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": QUANTITY_PATTERN,
    "x-kubernetes-int-or-string": True,
}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _hpa_scaling_rules() -> dict[str, Any]:
    policy = _object({"periodSeconds": INT32, "type": STRING, "value": INT32}, ["periodSeconds", "type", "value"])
    return _object(
        {
            "policies": {"type": "array", "items": policy, "x-kubernetes-list-type": "atomic"},
            "selectPolicy": STRING,
            "stabilizationWindowSeconds": INT32,
            "tolerance": QUANTITY,
        }
    )


SPEC = _object(
    {
        "advanced": _object(
            {
                "horizontalPodAutoscalerConfig": _object(
                    {
                        "behavior": _object({"scaleDown": _hpa_scaling_rules(), "scaleUp": _hpa_scaling_rules()}),
                        "name": STRING,
                    }
                ),
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "scalingModifiers": _object(
                    {"activationTarget": STRING, "formula": STRING, "metricType": STRING, "target": STRING}
                ),
            }
        ),
        "cooldownPeriod": INT32,
        "fallback": _object(
            {"behavior": STRING, "failureThreshold": INT32, "replicas": INT32}, ["failureThreshold", "replicas"]
        ),
        "idleReplicaCount": INT32,
        "initialCooldownPeriod": INT32,
        "maxReplicaCount": INT32,
        "minReplicaCount": INT32,
        "pollingInterval": INT32,
        "scaleTargetRef": _object(
            {"apiVersion": STRING, "envSourceContainerName": STRING, "kind": STRING, "name": STRING}, ["name"]
        ),
        "triggers": {
            "type": "array",
            "items": _object(
                {
                    "authenticationRef": _object({"kind": STRING, "name": STRING}, ["name"]),
                    "metadata": {"type": "object", "additionalProperties": STRING},
                    "metricType": STRING,
                    "name": STRING,
                    "type": STRING,
                    "useCachedMetrics": {"type": "boolean"},
                },
                ["metadata", "type"],
            ),
        },
    },
    ["scaleTargetRef", "triggers"],
)


def scaled_object_crd() -> dict[str, Any]:
    root = _object(
        {
            "apiVersion": STRING,
            "kind": STRING,
            "metadata": {"type": "object"},
            "spec": SPEC,
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
        ["spec"],
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "scaledobjects.keda.sh"},
        "spec": {
            "group": "keda.sh",
            "scope": "Namespaced",
            "names": {
                "kind": "ScaledObject",
                "listKind": "ScaledObjectList",
                "plural": "scaledobjects",
                "singular": "scaledobject",
                "shortNames": ["so"],
            },
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                }
            ],
        },
    }
