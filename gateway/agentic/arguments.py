"""One M3 tool-call argument, from the text between its element's tags to a JSON value typed by the tool's schema.

M3 writes scalars as bare text (``]<]minimax[>[<days>3]<]minimax[>[</days>``), so only the schema tells the integer
3 from the string "3": a scalar becomes the first of the schema's types its text is (integer, number, boolean, null,
object, array, in that order), else the text.  Without a schema it stays text.  Nested elements become an array
when the schema allows one and every element is an ``<item>``, else an object (a key written twice collects its
values in a list, so nothing the model wrote is lost).
"""

import json
import re
from collections.abc import Mapping
from typing import Any

from m3stack.gateway.agentic import m3_format
from m3stack.gateway.agentic.schema_types import JSON_TYPES, enum_values, items_schema, property_schema, value_types

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_TAG = re.compile(r"[^<>/\s]{1,256}")  # what an argument's element name may be


def argument_value(body: str, schema: Any, root: Any) -> Any:
    """The value of an argument whose element holds ``body``; ``root`` is the tool's parameters schema."""
    if body.lstrip().startswith(m3_format.ELEMENT_OPEN):
        elements = split_elements(body)
        if elements is not None:
            return _structured(elements, schema, root)
    return _scalar(body, schema, root)


def is_text_as_written(schema: Any, root: Any) -> bool:
    """Whether a scalar argument of ``schema`` is always its text as written (no schema, or a string one and no
    other enum value): its JSON is then known character by character, before its element closes."""
    types = value_types(schema, root)
    if types == JSON_TYPES:
        return True
    allowed = enum_values(schema, root)
    return types == {"string"} and (allowed is None or all(isinstance(value, str) for value in allowed))


def split_elements(body: str) -> list[tuple[str, str]] | None:
    """``body`` as a sequence of sibling elements ``[(name, inner text)]``; None when it is not one (text between
    the elements, an element left open, a closing tag that matches nothing)."""
    elements: list[tuple[str, str]] = []
    position = 0
    while True:
        while position < len(body) and body[position].isspace():
            position += 1
        if position == len(body):
            return elements
        if not body.startswith(m3_format.ELEMENT_OPEN, position) or body.startswith(m3_format.ELEMENT_CLOSE, position):
            return None
        name_start = position + len(m3_format.ELEMENT_OPEN)
        name_end = body.find(">", name_start)
        name = body[name_start:name_end] if name_end >= 0 else ""
        if not _TAG.fullmatch(name):
            return None
        inner_start = name_end + 1
        inner_end = matching_close(body, name, inner_start)
        if inner_end < 0:
            return None
        elements.append((name, body[inner_start:inner_end]))
        position = inner_end + len(m3_format.element_close(name))


def matching_close(text: str, name: str, start: int) -> int:
    """Where the element ``name`` opened before ``start`` closes (elements of the same name may nest); -1: not
    in ``text`` (yet)."""
    opening, closing = m3_format.element_open(name), m3_format.element_close(name)
    depth = 1
    position = start
    while True:
        close = text.find(closing, position)
        if close < 0:
            return -1
        nested = text.find(opening, position, close)
        if nested >= 0:
            depth += 1
            position = nested + len(opening)
            continue
        depth -= 1
        if depth == 0:
            return close
        position = close + len(closing)


def _structured(elements: list[tuple[str, str]], schema: Any, root: Any) -> Any:
    types = value_types(schema, root)
    if elements and "array" in types and all(name == m3_format.ARRAY_ITEM for name, _ in elements):
        entry_schema = items_schema(schema, root)
        return [argument_value(inner, entry_schema, root) for _, inner in elements]
    values: dict[str, Any] = {}
    for name, inner in elements:
        value = argument_value(inner, property_schema(schema, name, root), root)
        if name not in values:
            values[name] = value
        elif isinstance(values[name], _Repeated):
            values[name].append(value)
        else:
            values[name] = _Repeated([values[name], value])
    return {name: list(value) if isinstance(value, _Repeated) else value for name, value in values.items()}


class _Repeated(list[Any]):
    """The values of a key written more than once (told apart from a value that is itself a list)."""


def _scalar(text: str, schema: Any, root: Any) -> Any:
    types = value_types(schema, root)
    if types == JSON_TYPES:  # nothing to go by: the text as written
        return text
    allowed = enum_values(schema, root)
    if allowed is not None:
        for value in allowed:
            if value == text or (not isinstance(value, str) and json.dumps(value) == text.strip()):
                return value
    stripped = text.strip()
    if not stripped and "string" not in types:  # an empty element: the template writes [] and {} so
        if "array" in types:
            return []
        if "object" in types:
            return {}
    for json_type in ("integer", "number", "boolean", "null", "object", "array"):
        if json_type in types and (converted := _as_type(stripped, json_type)) is not _NOT_CONVERTED:
            return converted
    return text


_NOT_CONVERTED = object()


def _as_type(text: str, json_type: str) -> Any:
    if json_type == "integer":
        return int(text) if _INTEGER.fullmatch(text) else _NOT_CONVERTED
    if json_type == "number":
        return json.loads(text) if _NUMBER.fullmatch(text) else _NOT_CONVERTED
    if json_type == "boolean":
        lowered = text.lower()
        return lowered == "true" if lowered in ("true", "false") else _NOT_CONVERTED
    if json_type == "null":
        return None if text == "null" else _NOT_CONVERTED
    try:
        value = json.loads(text)
    except ValueError:
        return _NOT_CONVERTED
    wanted = Mapping if json_type == "object" else list
    return value if isinstance(value, wanted) else _NOT_CONVERTED
