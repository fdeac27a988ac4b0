"""Builders for structural OpenAPI v3 schemas (the CRD dialect) and the API server's defaulting.

The CRD in ``crd.py`` is written with these builders, so every node is typed and described, every
string and list has a bound (CEL's cost estimator rejects rules over unbounded values), and the
Python side applies exactly the defaults the API server applies (``apply_defaults``): one source
for both.
"""

import copy
from collections.abc import Iterable, Mapping
from typing import Any

Schema = dict[str, Any]

# Kubernetes' resource.Quantity grammar (apimachinery/pkg/api/resource), used on int-or-string fields.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# DNS-1123 subdomain: names of Secrets, PVCs, priority classes...
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def rule(expression: str, message: str, *, field_path: str | None = None, reason: str | None = None) -> Schema:
    """One ``x-kubernetes-validations`` entry: a CEL expression and the message a user sees."""
    entry: Schema = {"rule": expression, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def _node(kind: str, description: str, default: Any, rules: Iterable[Schema], extra: Mapping[str, Any]) -> Schema:
    node: Schema = {"type": kind, "description": description}
    node.update({key: value for key, value in extra.items() if value is not None})
    if default is not None:
        node["default"] = default
    rules = list(rules)
    if rules:
        node["x-kubernetes-validations"] = rules
    return node


def obj(
    description: str,
    properties: Mapping[str, Schema],
    *,
    required: Iterable[str] = (),
    default: Mapping[str, Any] | None = None,
    rules: Iterable[Schema] = (),
) -> Schema:
    """An object with fixed properties; ``default={}`` lets the children's defaults apply when it is absent.

    The default is stored expanded (the children's defaults filled in): the API server checks a
    default against the object's CEL rules as written, without defaulting inside it first.
    """
    node = _node("object", description, None, rules, {})
    node["properties"] = dict(properties)
    required = list(required)
    if required:
        node["required"] = required
    if default is not None:
        node["default"] = apply_defaults(node, dict(default))
    return node


def string(
    description: str,
    *,
    default: str | None = None,
    enum: Iterable[str] | None = None,
    pattern: str | None = None,
    min_length: int | None = None,
    max_length: int = 253,
    rules: Iterable[Schema] = (),
) -> Schema:
    return _node(
        "string",
        description,
        default,
        rules,
        {
            "enum": None if enum is None else list(enum),
            "pattern": pattern,
            "minLength": min_length,
            "maxLength": max_length,
        },
    )


def integer(
    description: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    fmt: str = "int32",
    rules: Iterable[Schema] = (),
) -> Schema:
    return _node("integer", description, default, rules, {"format": fmt, "minimum": minimum, "maximum": maximum})


def number(
    description: str,
    *,
    default: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool | None = None,
) -> Schema:
    return _node(
        "number",
        description,
        default,
        (),
        {"minimum": minimum, "maximum": maximum, "exclusiveMinimum": exclusive_minimum},
    )


def boolean(description: str, *, default: bool | None = None) -> Schema:
    return _node("boolean", description, default, (), {})


def quantity(description: str, *, default: str | None = None) -> Schema:
    """A resource.Quantity (``512Gi``, ``8``, ``500m``) accepted as an integer or a string."""
    node: Schema = {
        "description": description,
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }
    if default is not None:
        node["default"] = default
    return node


def string_map(description: str, *, max_properties: int = 64, value_max_length: int = 253) -> Schema:
    return {
        "type": "object",
        "description": description,
        "maxProperties": max_properties,
        "additionalProperties": {"type": "string", "maxLength": value_max_length},
    }


def quantity_map(description: str) -> Schema:
    item = quantity("a resource quantity")
    del item["description"]
    return {"type": "object", "description": description, "maxProperties": 16, "additionalProperties": item}


def array(
    description: str,
    items: Schema,
    *,
    max_items: int,
    list_type: str = "atomic",
    map_keys: Iterable[str] | None = None,
    rules: Iterable[Schema] = (),
) -> Schema:
    node = _node("array", description, None, rules, {"maxItems": max_items, "x-kubernetes-list-type": list_type})
    node["items"] = items
    if map_keys is not None:
        node["x-kubernetes-list-map-keys"] = list(map_keys)
    return node


def preserved(description: str) -> Schema:
    """A free-form object kept as written (for embedded Kubernetes types we pass through unchanged)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


# ------------------------------------------------------------------------------------------------
# Defaulting, as the API server does it for structural schemas: for every object that is present,
# each missing property with a default gets a deep copy of that default, then defaulting recurses
# into every present property (defaults included, so ``default: {}`` lets nested defaults apply).


def apply_defaults(schema: Schema, value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults filled in; ``value`` is not modified."""
    return _default(schema, copy.deepcopy(value))


def _default(schema: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        properties: Mapping[str, Schema] = schema.get("properties", {})
        for key, child in properties.items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
        for key, item in value.items():
            if key in properties:
                value[key] = _default(properties[key], item)
            elif isinstance(schema.get("additionalProperties"), dict):
                value[key] = _default(schema["additionalProperties"], item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], item) for item in value]
    return value
