"""Grammars for forced tool calls and JSON output, checked with llguidance's own matcher (the engine's) on the tiny
model's tokenizer: what they accept and refuse, and that any path through them parses and validates."""

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest

from m3stack.gateway.agentic.grammar import GrammarError, LarkWriter, json_grammar, tool_call_grammar
from m3stack.gateway.agentic.m3_format import MARKER_TOKENS, NAMESPACE, THINK_CLOSE
from m3stack.gateway.agentic.output_parser import OutputStart
from tests.helpers.m3_output import m3_assistant_text, parse_pieces

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hours": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "window": {"anyOf": [{"$ref": "#/$defs/Window"}, {"type": "null"}]},
        "precise": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "$defs": {"Window": {"type": "object", "properties": {"start": {"type": "number"}}, "required": ["start"]}},
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"]}
GOOD_ARGS = {"city": "Paris", "days": 3, "unit": "celsius", "hours": [6, 12], "window": {"start": 1.5}, "precise": True}


@pytest.fixture(scope="module")
def llg(tiny_model_dir, tokenizer):
    return llguidance.LLTokenizer(
        (tiny_model_dir / "tokenizer.json").read_text(),
        n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids),
    )


@pytest.fixture(scope="module")
def writer(tokenizer):
    return LarkWriter(tokenizer.special_token_ids)


def matcher(llg, grammar: str) -> llguidance.LLMatcher:
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(lark, llg) == ""
    return llguidance.LLMatcher(llg, lark, log_level=0)


def accepts(llg, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` (tokenized as the model would emit it) as a complete output."""
    match = matcher(llg, grammar)
    return all(match.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        match.is_accepting()
    )


def walk(llg, tokenizer, grammar: str, seed: int, limit: int = 500) -> tuple[str, bool]:
    """A random model: at each step any token the grammar allows, uniformly.  The text and whether it completed."""
    rng = random.Random(seed)
    match = matcher(llg, grammar)
    ids: list[int] = []
    while not match.is_stopped() and len(ids) < limit:
        bits = np.unpackbits(np.frombuffer(match.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = [int(t) for t in np.nonzero(bits[: tokenizer.vocab_size])[0] if t not in tokenizer.eos_token_ids]
        token = rng.choice(allowed)
        assert match.consume_token(token)
        ids.append(token)
    return tokenizer.keeping(MARKER_TOKENS).decode(ids), match.is_stopped()


def call_text(*calls) -> str:
    return m3_assistant_text("", None, calls).removeprefix(THINK_CLOSE)


def test_special_tokens_are_written_as_token_ids(tokenizer, writer):
    namespace = tokenizer.token_to_id(NAMESPACE)
    assert writer.literal(f"{NAMESPACE}<tool_call>\n") == (
        f'<[{namespace}]> <[{tokenizer.token_to_id("<tool_call>")}]> "\\n"'
    )
    assert writer.literal('say "hi"') == '"say \\"hi\\""'


def test_a_named_call_takes_valid_calls_only(llg, tokenizer, writer):
    grammar = tool_call_grammar([("get_weather", WEATHER)], False, OutputStart.CONTENT, writer, "tools")
    assert accepts(llg, tokenizer, grammar, call_text(("get_weather", GOOD_ARGS)))
    assert accepts(llg, tokenizer, grammar, call_text(("get_weather", {"city": "", "days": -7})))
    refused = [
        {"city": "Paris"},  # a required argument missing
        {**GOOD_ARGS, "days": "three"},  # not an integer
        {**GOOD_ARGS, "unit": "kelvin"},  # not in the enum
        {**GOOD_ARGS, "city": "Ouagadougou"},  # longer than maxLength
        {**GOOD_ARGS, "hours": []},  # fewer than minItems
        {**GOOD_ARGS, "window": {}},  # a required nested property missing
        {**GOOD_ARGS, "extra": 1},  # not a property
    ]
    for args in refused:
        assert not accepts(llg, tokenizer, grammar, call_text(("get_weather", args))), args
    assert not accepts(llg, tokenizer, grammar, call_text(("search", {"query": "x"})))
    assert not accepts(llg, tokenizer, grammar, call_text(("get_weather", GOOD_ARGS), ("get_weather", GOOD_ARGS)))
    assert not accepts(llg, tokenizer, grammar, "Sure! " + call_text(("get_weather", GOOD_ARGS)))


def test_a_required_call_may_use_any_tool_and_several_in_parallel(llg, tokenizer, writer):
    grammar = tool_call_grammar([("get_weather", WEATHER), ("search", SEARCH)], True, OutputStart.CONTENT, writer, "t")
    assert accepts(llg, tokenizer, grammar, call_text(("search", {"query": "x"}), ("get_weather", GOOD_ARGS)))
    assert not accepts(llg, tokenizer, grammar, "No call.")
    assert not accepts(llg, tokenizer, grammar, "")


def test_thinking_mode_decides_what_may_come_before_the_call(llg, tokenizer, writer):
    call = call_text(("search", {"query": "x"}))
    adaptive = tool_call_grammar([("search", SEARCH)], False, OutputStart.EITHER, writer, "t")
    assert accepts(llg, tokenizer, adaptive, call) and accepts(llg, tokenizer, adaptive, THINK_CLOSE + call)
    assert not accepts(llg, tokenizer, adaptive, f"<mm:think>plan{THINK_CLOSE}{call}")
    enabled = tool_call_grammar([("search", SEARCH)], False, OutputStart.REASONING, writer, "t")
    assert accepts(llg, tokenizer, enabled, f"a plan{THINK_CLOSE}{call}")
    assert not accepts(llg, tokenizer, enabled, call)


@pytest.mark.parametrize("start", [OutputStart.EITHER, OutputStart.CONTENT])
def test_any_path_through_a_call_grammar_parses_and_validates(llg, tokenizer, writer, start):
    tools = {"get_weather": WEATHER, "search": SEARCH}
    grammar = tool_call_grammar(list(tools.items()), True, start, writer, "tools")
    completed = 0
    for seed in range(12):
        text, stopped = walk(llg, tokenizer, grammar, seed)
        if not stopped:
            continue  # ran past the step limit (digits or parallel calls can repeat)
        completed += 1
        parsed = parse_pieces([text], start, tools)
        assert parsed.content == "" and parsed.calls, text
        for call in parsed.calls.values():
            jsonschema.validate(json.loads(call["arguments"]), tools[call["name"]])
    assert completed >= 8


def test_any_path_through_a_json_grammar_validates(llg, tokenizer, writer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    grammar = json_grammar(schema, OutputStart.EITHER, writer)
    for seed in range(8):
        text, stopped = walk(llg, tokenizer, grammar, seed)
        assert stopped
        parsed = parse_pieces([text], OutputStart.EITHER, None)
        jsonschema.validate(json.loads(parsed.content), schema)
    assert accepts(llg, tokenizer, grammar, '</mm:think>{"a": 1, "b": "y"}')
    assert not accepts(llg, tokenizer, grammar, '{"a": 1}')


def test_json_or_a_call(llg, tokenizer, writer):
    grammar = tool_call_grammar([("search", SEARCH)], True, OutputStart.CONTENT, writer, "t", or_json={"type": "array"})
    assert accepts(llg, tokenizer, grammar, "[1, 2]")
    assert accepts(llg, tokenizer, grammar, call_text(("search", {"query": "q"})))
    assert not accepts(llg, tokenizer, grammar, '{"a": 1}')


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"x": {"type": "string", "pattern": "^a+$"}}}, "pattern"),
        ({"type": "object", "properties": {"x": {"type": "string", "format": "date-time"}}}, "format"),
        ({"type": "object", "properties": {"x": {"type": "integer", "minimum": 1}}}, "minimum"),
        ({"type": "object", "properties": {"x": {"type": "object"}}}, "free-form"),
        ({"type": "object", "properties": {"x": {"description": "anything"}}}, "without a type"),
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}, "does not point"),
    ],
)
def test_what_a_call_grammar_cannot_enforce_is_named(writer, schema, named):
    with pytest.raises(GrammarError, match=named) as caught:
        tool_call_grammar([("f", schema)], False, OutputStart.CONTENT, writer, "tools")
    assert caught.value.param.startswith("tools[0].function.parameters.properties.x")
