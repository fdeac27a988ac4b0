"""What a JSON schema says about one value: its possible types, an object's properties, an array's items.

Tool arguments arrive as text (M3 writes every scalar as its text); their schema decides whether ``42`` is the
integer or the string.  Schemas come from clients, so every reader here takes any JSON and never raises:
what it cannot read counts as unconstrained.
"""

from collections.abc import Mapping
from typing import Any

JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
# A JSON pointer into the schema's own document: "#/$defs/Address" (pydantic), "#/definitions/Address" (older).
_LOCAL_REF = "#/"
_MAX_REF_DEPTH = 32  # a $ref chain longer than this is a cycle


def resolve(schema: Any, root: Any) -> Mapping[str, Any] | None:
    """``schema`` with local ``$ref``s followed (None: not a schema object, or a reference that leads nowhere)."""
    for _ in range(_MAX_REF_DEPTH):
        if not isinstance(schema, Mapping):
            return None
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            return schema
        schema = _pointer(root, ref)
    return None


def _pointer(root: Any, ref: str) -> Any:
    if not ref.startswith(_LOCAL_REF):
        return None
    node = root
    for escaped in ref[len(_LOCAL_REF) :].split("/"):
        key = escaped.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def alternatives(schema: Mapping[str, Any], root: Any) -> list[Mapping[str, Any]]:
    """The schemas a value may match: the ``anyOf``/``oneOf`` branches (flattened), else the schema itself."""
    branches = schema.get("anyOf") or schema.get("oneOf")
    if not isinstance(branches, list):
        return [schema]
    found: list[Mapping[str, Any]] = []
    for branch in branches:
        resolved = resolve(branch, root)
        if resolved is not None:
            found.extend(alternatives(resolved, root))
    return found


def value_types(schema: Any, root: Any) -> frozenset[str]:
    """The JSON types a value of ``schema`` may have; every type when the schema does not say."""
    resolved = resolve(schema, root)
    if resolved is None:
        return JSON_TYPES
    types: set[str] = set()
    for branch in alternatives(resolved, root):
        types |= _branch_types(branch)
    return frozenset(types) or JSON_TYPES


def _branch_types(schema: Mapping[str, Any]) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared} & JSON_TYPES
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)} & JSON_TYPES
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values is not None:
        return {_type_of(value) for value in values}
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return set(JSON_TYPES)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def property_schema(schema: Any, name: str, root: Any) -> Any:
    """The schema of property ``name`` of an object value (None: unknown)."""
    resolved = resolve(schema, root)
    if resolved is None:
        return None
    for branch in alternatives(resolved, root):
        properties = branch.get("properties")
        if isinstance(properties, Mapping) and name in properties:
            return properties[name]
        extra = branch.get("additionalProperties")
        if isinstance(extra, Mapping):
            return extra
    return None


def items_schema(schema: Any, root: Any) -> Any:
    """The schema of an array value's entries (None: unknown)."""
    resolved = resolve(schema, root)
    if resolved is None:
        return None
    for branch in alternatives(resolved, root):
        items = branch.get("items")
        if isinstance(items, Mapping):
            return items
    return None


def enum_values(schema: Any, root: Any) -> list[Any] | None:
    """The values an ``enum``/``const`` allows, over every branch (None: not an enumeration)."""
    resolved = resolve(schema, root)
    if resolved is None:
        return None
    values: list[Any] = []
    for branch in alternatives(resolved, root):
        if isinstance(branch.get("enum"), list):
            values.extend(branch["enum"])
        elif "const" in branch:
            values.append(branch["const"])
        else:
            return None
    return values
