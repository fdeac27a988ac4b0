"""Tool-call argument text to JSON values, typed by the tool's schema (M3 writes every scalar as bare text)."""

import pytest

from m3stack.gateway.agentic.arguments import argument_value
from m3stack.gateway.agentic.m3_format import NAMESPACE as NS

ROOT = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("42", {"type": "string"}, "42"),
        ("42", None, "42"),  # no schema: the text as written
        (" 42 ", {"type": "integer"}, 42),
        (" 42 ", {"type": "string"}, " 42 "),
        ("4.5e1", {"type": "number"}, 45.0),
        ("7", {"type": "number"}, 7),
        ("true", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),
        ("null", {"type": ["integer", "null"]}, None),
        ("12", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 12),
        ("12a", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "12a"),
        ("3", {"enum": [1, 2, 3]}, 3),
        ("a", {"enum": ["a", "b"]}, "a"),
        ("seven", {"type": "integer"}, "seven"),  # not what the schema says: kept, never dropped
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("", {"type": "array"}, []),
        ("", {"type": "object"}, {}),
        ("", {"type": "string"}, ""),
        (f"{NS}<item>1{NS}</item>{NS}<item>2{NS}</item>", {"type": "array", "items": {"type": "integer"}}, [1, 2]),
        (f"{NS}<x>1{NS}</x>{NS}<y>2.5{NS}</y>", {"$ref": "#/$defs/Point"}, {"x": 1, "y": 2.5}),
        # Same-name elements nest; a key written twice keeps both values.
        (f"{NS}<a>{NS}<a>x{NS}</a>{NS}</a>", None, {"a": {"a": "x"}}),
        (f"{NS}<k>1{NS}</k>{NS}<k>2{NS}</k>", None, {"k": ["1", "2"]}),
        # Not a sequence of elements: text.
        (f"{NS}<k>1{NS}</k> tail", {"type": "string"}, f"{NS}<k>1{NS}</k> tail"),
    ],
)
def test_argument_values(text, schema, value):
    assert argument_value(text, schema, ROOT if schema is None or "$ref" in schema else schema) == value
