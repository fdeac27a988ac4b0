"""Grammars for constrained decoding, in llguidance's Lark dialect (engine.proto ``Grammar.lark``).

* ``response_format`` JSON: the body is ``%json{schema}`` (llguidance compiles the schema itself).
* A forced tool call (``tool_choice`` required or named): one M3 tool-call block whose invokes name the allowed tools
  and whose arguments follow each tool's schema in M3's XML form (``arguments.py`` reads them back), so the call
  parses and validates whatever the weights are.  The translation covers the JSON Schema an argument list is
  written in (types, enums and consts, properties and required, items and their counts, string lengths, anyOf,
  local $refs); any other keyword is a ``GrammarError`` naming it, never a grammar that lets invalid calls through.

Marker texts that are special tokens of the model (``]<]minimax[>[``, ``<tool_call>``, ``</mm:think>``) are written
as those tokens (``<[id]>``), as the chat template's text tokenizes: a model emits them as one token each.

Before the body comes what the thinking mode allows (``OutputStart``): the reasoning and its ``</mm:think>`` when the
prompt opened it, an optional bare ``</mm:think>`` when the model may decide (a forced output skips adaptive
thinking: unconstrained reasoning could run to the token limit and leave no room for the body), nothing when off.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from m3stack.gateway.agentic import m3_format
from m3stack.gateway.agentic.output_parser import OutputStart
from m3stack.gateway.agentic.schema_types import resolve

# Keywords that describe a value without constraining it.
_ANNOTATIONS = frozenset(
    {
        *("title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated"),
        *("readOnly", "writeOnly", "$defs", "definitions", "strict"),
    }
)
_BRANCHING = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset(),
    "number": frozenset(),
    "boolean": frozenset(),
    "null": frozenset(),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
_MAX_DEPTH = 32
_INTEGER = "/-?(0|[1-9][0-9]*)/"
_NUMBER = "/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/"


class GrammarError(ValueError):
    """A schema the grammar cannot enforce; ``param`` is where (``tools[0].function.parameters.properties.x``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LarkWriter:
    """Lark literals for the model: text with its special tokens written as ``<[id]>``."""

    special_token_ids: Mapping[str, int]

    def literal(self, text: str) -> str:
        parts: list[str] = []
        plain_start = position = 0
        specials = sorted((t for t in self.special_token_ids if t and t in text), key=len, reverse=True)
        while position < len(text):
            token = next((t for t in specials if text.startswith(t, position)), None)
            if token is None:
                position += 1
                continue
            if position > plain_start:
                parts.append(_quoted(text[plain_start:position]))
            parts.append(f"<[{self.special_token_ids[token]}]>")
            position += len(token)
            plain_start = position
        if plain_start < len(text):
            parts.append(_quoted(text[plain_start:]))
        return " ".join(parts) if parts else '""'


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def json_grammar(schema: Mapping[str, Any], start: OutputStart, writer: LarkWriter) -> str:
    """Output that is one JSON value of ``schema`` (after what the thinking mode allows)."""
    return f"start: {_prefix(start, writer)} %json{json.dumps(schema, ensure_ascii=False)}\n"


def tool_call_grammar(
    tools: Sequence[tuple[str, Any]],
    parallel: bool,
    start: OutputStart,
    writer: LarkWriter,
    param: str,
    or_json: Mapping[str, Any] | None = None,
) -> str:
    """Output that is one M3 tool-call block of invokes of ``tools`` ((name, parameters schema) pairs), one or more
    of them when ``parallel``; or, given ``or_json``, a JSON value of that schema instead.  ``param`` names where
    the tools came from, for errors."""
    rules = _Rules(writer)
    invokes = [rules.invoke(name, parameters, f"{param}[{i}]") for i, (name, parameters) in enumerate(tools)]
    rules.add("invoke", " | ".join(invokes))
    calls = f"{writer.literal(m3_format.CALLS_OPEN + chr(10))} invoke{'+' if parallel else ''} "
    calls += writer.literal(m3_format.CALLS_CLOSE)
    if or_json is not None:
        calls = f"({calls} | %json{json.dumps(or_json, ensure_ascii=False)})"
    return f"start: {_prefix(start, writer)} {calls}\n" + rules.text()


def _prefix(start: OutputStart, writer: LarkWriter) -> str:
    if start is OutputStart.REASONING:
        return f"/(?s:.*)/ {writer.literal(m3_format.THINK_CLOSE)}"
    if start is OutputStart.EITHER:
        return f"({writer.literal(m3_format.THINK_CLOSE)})?"
    return ""


@dataclass
class _Rules:
    """The rules of an argument grammar, named as they are made (``$ref`` targets once, so recursion works)."""

    writer: LarkWriter
    rules: list[str] = field(default_factory=list)
    by_ref: dict[str, str] = field(default_factory=dict)
    count: int = 0

    def add(self, name: str, expansion: str) -> str:
        self.rules.append(f"{name}: {expansion}")
        return name

    def new_name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}_{self.count}"

    def text(self) -> str:
        return "".join(rule + "\n" for rule in self.rules)

    def invoke(self, name: str, parameters: Any, param: str) -> str:
        root = parameters if parameters is not None else {}
        opening = self.writer.literal(f"{m3_format.INVOKE_OPEN}{name}{m3_format.INVOKE_NAME_END}")
        closing = self.writer.literal(m3_format.INVOKE_CLOSE + "\n")
        body = self.value(root, root, f"{param}.function.parameters", 0, top_level=True)
        return self.add(self.new_name("call"), f"{opening} {body} {closing}")

    def element(self, tag: str, content: str) -> str:
        opening = self.writer.literal(m3_format.element_open(tag))
        return f"{opening} ({content}) {self.writer.literal(m3_format.element_close(tag))}"

    def value(self, schema: Any, root: Any, param: str, depth: int, top_level: bool = False) -> str:
        """A rule for the text inside an element holding a value of ``schema``."""
        if depth > _MAX_DEPTH:
            raise GrammarError(f"{param}: the schema nests deeper than {_MAX_DEPTH} levels", param)
        if isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str):
            ref = schema["$ref"]
            if ref not in self.by_ref:
                target = resolve(schema, root)
                if target is None:
                    raise GrammarError(f"{param}: $ref {ref!r} does not point into this schema", param)
                self.by_ref[ref] = name = self.new_name("ref")
                self.add(name, self.value(target, root, param, depth + 1))
            return self.by_ref[ref]
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{param}: a schema must be an object", param)
        if top_level and not schema:
            return '""'  # no parameters at all
        _check_keywords(schema, param)
        branches = self._branches(schema, root, param, depth)
        if not branches:
            raise GrammarError(f"{param}: this schema allows only null, which a tool call cannot write", param)
        return branches[0] if len(branches) == 1 else self.add(self.new_name("alt"), " | ".join(branches))

    def _branches(self, schema: Mapping[str, Any], root: Any, param: str, depth: int) -> list[str]:
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list):
                    raise GrammarError(f"{param}.{keyword} must be a list", param)
                return [
                    self.value(option, root, f"{param}.{keyword}[{i}]", depth + 1)
                    for i, option in enumerate(options)
                    if not _only_null(option, root)
                ]
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise GrammarError(f"{param}: allOf with more than one schema is not supported", param)
            return [self.value(parts[0], root, f"{param}.allOf[0]", depth + 1)]
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return self._enumeration(values, param)
        declared = schema.get("type")
        types = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
        if types is None:
            types = ["object"] if "properties" in schema else ["array"] if "items" in schema else None
        if types is None:
            raise GrammarError(f"{param}: a value without a type cannot be constrained (give it a type)", param)
        return [self._typed(t, schema, root, param, depth) for t in types if t != "null"]

    def _enumeration(self, values: Any, param: str) -> list[str]:
        if not isinstance(values, list) or not values:
            raise GrammarError(f"{param}: enum must be a non-empty list", param)
        texts = []
        for value in values:
            if isinstance(value, (dict, list)):
                raise GrammarError(f"{param}: enum values that are objects or arrays are not supported", param)
            if value is not None:
                texts.append(value if isinstance(value, str) else json.dumps(value))
        return [" | ".join(self.writer.literal(text) for text in texts)] if texts else []

    def _typed(self, json_type: Any, schema: Mapping[str, Any], root: Any, param: str, depth: int) -> str:
        if json_type not in _BY_TYPE:
            raise GrammarError(f"{param}: unknown type {json_type!r}", param)
        if json_type == "string":
            return self._string(schema, param)
        if json_type == "integer":
            return _INTEGER
        if json_type == "number":
            return _NUMBER
        if json_type == "boolean":
            return '"true" | "false"'
        if json_type == "array":
            return self._array(schema, root, param, depth)
        return self._object(schema, root, param, depth)

    def _string(self, schema: Mapping[str, Any], param: str) -> str:
        low, high = _bound(schema, "minLength", param), _bound(schema, "maxLength", param)
        if low is None and high is None:
            return "/(?s:.*)/"
        return f"/(?s:.{{{low or 0},{'' if high is None else high}}})/"

    def _array(self, schema: Mapping[str, Any], root: Any, param: str, depth: int) -> str:
        items = schema.get("items")
        if not isinstance(items, Mapping):
            raise GrammarError(f"{param}: an array needs an items schema to be constrained", param)
        entry = self.value(items, root, f"{param}.items", depth + 1)
        element = self.add(self.new_name("item"), self.element(m3_format.ARRAY_ITEM, entry))
        low, high = _bound(schema, "minItems", param) or 0, _bound(schema, "maxItems", param)
        if high is None:
            return f"{element}*" if low == 0 else f"{element}~{low} {element}*"
        return f"({element}~{low}..{high})?" if low == 0 else f"{element}~{low}..{high}"

    def _object(self, schema: Mapping[str, Any], root: Any, param: str, depth: int) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            raise GrammarError(
                f"{param}: an object without properties (free-form keys) cannot be constrained; list its properties",
                param,
            )
        required = schema.get("required", [])
        if not isinstance(required, list):
            raise GrammarError(f"{param}.required must be a list", param)
        if missing := [name for name in required if name not in properties]:
            raise GrammarError(f"{param}: required properties {missing} are not in properties", param)
        parts = []
        for name, property_schema in properties.items():
            where = f"{param}.properties.{name}"
            if _only_null(property_schema, root):
                continue  # a null argument is left out
            element = self.element(name, self.value(property_schema, root, where, depth + 1))
            parts.append(f"({element})" if name in required else f"({element})?")
        return " ".join(parts) if parts else '""'


def _check_keywords(schema: Mapping[str, Any], param: str) -> None:
    known = _ANNOTATIONS | _BRANCHING | {key for keys in _BY_TYPE.values() for key in keys}
    unsupported = sorted(key for key in schema if key not in known)
    if unsupported:
        raise GrammarError(
            f"{param}: {', '.join(unsupported)} cannot be enforced in constrained tool calls (supported: types, "
            "enum, const, properties, required, items, minItems, maxItems, minLength, maxLength, anyOf, $ref)",
            param,
        )


def _bound(schema: Mapping[str, Any], keyword: str, param: str) -> int | None:
    value = schema.get(keyword)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GrammarError(f"{param}.{keyword} must be a non-negative integer", param)
    return value


def _only_null(schema: Any, root: Any) -> bool:
    resolved = resolve(schema, root)
    if resolved is None:
        return False
    declared = resolved.get("type")
    return declared in ("null", ["null"]) or ("const" in resolved and resolved["const"] is None)
