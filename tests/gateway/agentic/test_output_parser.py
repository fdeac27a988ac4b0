"""The M3 output parser on M3-format text (written by M3's template layout): content, reasoning and tool calls, the
same however the text is split, nothing dropped when a block is malformed."""

import codecs
import json

import pytest

from m3stack.gateway.agentic import m3_format
from m3stack.gateway.agentic.output_parser import OutputParser, OutputStart, output_start
from tests.helpers.m3_output import m3_assistant_text, parse_pieces

NS = m3_format.NAMESPACE
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "threshold": {"type": "number"},
        "window": {"$ref": "#/$defs/Window"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    },
    "required": ["city"],
    "$defs": {"Window": {"type": "object", "properties": {"hours": {"type": "array", "items": {"type": "integer"}}}}},
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}
TOOLS = {"get_weather": WEATHER, "search": SEARCH}
NESTED_ARGS = {
    "city": 'Paris <3 & "quotes"\nline two',
    "days": 3,
    "metric": True,
    "threshold": -2.5,
    "window": {"hours": [0, 6, 12]},
    "tags": ["a", "b c"],
    "note": "007x",
}
SEARCH_ARGS = {"query": "42", "filters": {"site": "example.org", "year": {"from": "2020"}}}


def every_split(text: str):
    """Two pieces at every character boundary, then one character at a time."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


def test_parallel_calls_with_nested_arguments_typed_by_schema():
    text = m3_assistant_text("Let me check.", "The user wants weather.", [("get_weather", NESTED_ARGS),
                                                                        ("search", SEARCH_ARGS)])  # fmt: skip
    parsed = parse_pieces([text], OutputStart.EITHER, TOOLS)
    assert parsed.reasoning == "The user wants weather."
    assert parsed.content == "Let me check."
    assert [call["name"] for call in parsed.calls.values()] == ["get_weather", "search"]
    assert [call["id"] for call in parsed.calls.values()] == ["call_0", "call_1"]
    assert parsed.arguments(0) == NESTED_ARGS
    # "42" is a string by the schema; the free-form object's leaves stay text (no schema to type them by).
    assert parsed.arguments(1) == SEARCH_ARGS
    assert parsed.calls[0]["arguments"] == json.dumps(NESTED_ARGS, ensure_ascii=False)
    assert parsed.called


@pytest.mark.parametrize(
    ("start", "reasoning"), [(OutputStart.EITHER, "plan"), (OutputStart.REASONING, "plan"), (OutputStart.CONTENT, None)]
)
def test_the_same_result_at_every_split(start, reasoning):
    text = m3_assistant_text("Answer: ", reasoning, [("get_weather", NESTED_ARGS), ("search", SEARCH_ARGS)])
    if start is OutputStart.REASONING:
        text = text.removeprefix(m3_format.THINK_OPEN)  # the prompt opened the reasoning
    elif start is OutputStart.CONTENT:
        text = text.removeprefix(m3_format.THINK_CLOSE)  # the prompt closed it
    whole = parse_pieces([text], start, TOOLS)
    assert whole.arguments(0) == NESTED_ARGS and whole.arguments(1) == SEARCH_ARGS
    assert whole.reasoning == (reasoning or "") and whole.content == "Answer: "
    for pieces in every_split(text):
        assert parse_pieces(pieces, start, TOOLS) == whole


def new_parser(tools=TOOLS) -> OutputParser:
    ids = iter(range(100))
    return OutputParser(OutputStart.EITHER, tools, lambda: f"call_{next(ids)}")


def stream_deltas(pieces, tools=TOOLS) -> list[tuple[str | None, str | None, str]]:
    parser = new_parser(tools)
    deltas = [delta for piece in pieces for delta in parser.feed(piece).tool_calls]
    deltas.extend(parser.finish().tool_calls)
    return [(d.id, d.name, d.arguments) for d in deltas]


def test_a_string_argument_streams_as_it_arrives_and_others_once_closed():
    text = m3_assistant_text("", None, [("get_weather", {"city": "Oslo", "days": 2, "note": "7"})])
    assert stream_deltas(list(text)) == [
        ("call_0", "get_weather", ""),
        (None, None, '{"city": "'),
        (None, None, "O"),
        (None, None, "s"),
        (None, None, "l"),
        (None, None, "o"),
        (None, None, '"'),
        (None, None, ', "days": 2'),  # an integer: known once its element closes
        (None, None, ', "note": 7'),  # integer or string: the schema types it once the text is complete
        (None, None, "}"),
    ]


LONG = "".join(f'line {i}: a \\ quoted "word" and caf\u00e9 \u2603\n' for i in range(40))


def test_a_long_string_is_in_the_arguments_as_far_as_it_is_written():
    """At every cut inside the string, the arguments so far are the string up to the cut: nothing waits for the
    element to close."""
    text = m3_assistant_text("", None, [("search", {"query": LONG, "filters": {"site": "x"}})])
    final = json.dumps({"query": LONG, "filters": {"site": "x"}}, ensure_ascii=False)
    body_start = text.index(LONG)
    for cut in range(len(text) + 1):
        parser = new_parser()
        so_far = "".join(delta.arguments for delta in parser.feed(text[:cut]).tool_calls)
        assert final.startswith(so_far), cut
        if body_start < cut <= body_start + len(LONG):  # (from its first character: text, not elements)
            assert so_far == '{"query": "' + json.dumps(LONG[: cut - body_start], ensure_ascii=False)[1:-1], cut
        rest = parser.feed(text[cut:]).tool_calls + parser.finish().tool_calls
        assert so_far + "".join(delta.arguments for delta in rest) == final


def test_every_byte_split_of_utf8_output_gives_the_typed_arguments():
    """The engine's bytes cut anywhere, decoded as a detokenizer does (a character once all its bytes are in)."""
    args = {"city": 'Zürich ☃ 東京 "q"', "days": 3, "tags": ["ä", "b"]}
    text = m3_assistant_text("Ok.", "think", [("get_weather", args), ("search", {"query": "𝄞 music"})])
    encoded = text.encode()
    whole = parse_pieces([text], OutputStart.EITHER, TOOLS)
    assert (whole.arguments(0), whole.arguments(1)) == (args, {"query": "𝄞 music"})
    for cut in range(len(encoded) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces = [decoder.decode(encoded[:cut]), decoder.decode(encoded[cut:], final=True)]
        assert parse_pieces(pieces, OutputStart.EITHER, TOOLS) == whole, cut


def test_markup_inside_a_string_argument_stays_its_text():
    """M3 writes a string as it is: an element of the argument's own name inside it nests, and it all is the text."""
    query = f"a {NS}<query>b{NS}</query> c {NS}<x> ]<] d"
    text = m3_assistant_text("", None, [("search", {"query": query})])
    for pieces in every_split(text):
        parsed = parse_pieces(pieces, OutputStart.EITHER, TOOLS)
        assert parsed.arguments(0) == {"query": query} and parsed.content == ""


def test_a_string_argument_written_as_elements_is_typed_when_it_closes():
    block = f'{NS}<tool_call>\n{NS}<invoke name="search">{NS}<query> {NS}<a>1{NS}</a>{NS}</query>{NS}</invoke>'
    for pieces in every_split(block + f"\n{NS}</tool_call>"):
        assert parse_pieces(pieces, OutputStart.CONTENT, TOOLS).arguments(0) == {"query": {"a": "1"}}
    assert stream_deltas([block])[1:] == [(None, None, '{"query": {"a": "1"}'), (None, None, "}")]


def test_reasoning_split_by_thinking_mode():
    assert parse_pieces(["<mm:think>a plan</mm:think>The answer."], OutputStart.EITHER, None).reasoning == "a plan"
    skipped = parse_pieces(["</mm:think>The answer."], OutputStart.EITHER, None)
    assert (skipped.reasoning, skipped.content) == ("", "The answer.")
    direct = parse_pieces(["The answer."], OutputStart.EITHER, None)
    assert (direct.reasoning, direct.content) == ("", "The answer.")
    opened = parse_pieces(["a plan</mm:think>The answer."], OutputStart.REASONING, None)
    assert (opened.reasoning, opened.content) == ("a plan", "The answer.")
    # Once content has started, think markers are text; thinking off reads everything as content.
    later = parse_pieces(["Say <mm:think>x</mm:think> done"], OutputStart.EITHER, None)
    assert (later.reasoning, later.content) == ("", "Say <mm:think>x</mm:think> done")
    off = parse_pieces(["<mm:think>x</mm:think>y"], OutputStart.CONTENT, None)
    assert off.content == "<mm:think>x</mm:think>y"
    # Output cut inside the reasoning: all of it is reasoning.
    assert parse_pieces(["<mm:think>unfinished"], OutputStart.EITHER, None).reasoning == "unfinished"


def test_output_start_follows_the_generation_prompt():
    assert output_start("]~b]ai\n<mm:think>") is OutputStart.REASONING
    assert output_start("]~b]ai\n</mm:think>") is OutputStart.CONTENT
    assert output_start("]~b]ai\n") is OutputStart.EITHER


def test_a_call_inside_the_reasoning_is_a_call_and_the_reasoning_goes_on():
    block = m3_assistant_text("", None, [("search", {"query": "x"})]).removeprefix(m3_format.THINK_CLOSE)
    text = f"<mm:think>First search.{block} Then answer.</mm:think>Done."
    parsed = parse_pieces([text], OutputStart.EITHER, TOOLS)
    assert parsed.reasoning == "First search. Then answer."
    assert parsed.content == "Done."
    assert parsed.calls[0]["name"] == "search" and parsed.arguments(0) == {"query": "x"}


def test_calls_after_reasoning_and_text_around_the_block():
    block = m3_assistant_text("", None, [("search", {"query": "x"})]).removeprefix(m3_format.THINK_CLOSE)
    parsed = parse_pieces([f"Before. {block} After."], OutputStart.CONTENT, TOOLS)
    assert parsed.content == "Before.  After."
    assert parsed.arguments(0) == {"query": "x"}


def test_without_tools_a_call_block_is_content():
    block = m3_assistant_text("", None, [("search", {"query": "x"})]).removeprefix(m3_format.THINK_CLOSE)
    parsed = parse_pieces([block], OutputStart.CONTENT, None)
    assert parsed.content == block and not parsed.calls and not parsed.called


def test_an_unknown_tool_is_still_a_call_with_text_arguments():
    block = f'{NS}<tool_call>\n{NS}<invoke name="other">{NS}<n>5{NS}</n>{NS}</invoke>\n{NS}</tool_call>'
    parsed = parse_pieces([block], OutputStart.CONTENT, TOOLS)
    assert parsed.calls[0]["name"] == "other" and parsed.arguments(0) == {"n": "5"}


def test_empty_arrays_objects_and_no_arguments():
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}},
                                               "o": {"type": "object", "properties": {}}}}  # fmt: skip
    text = m3_assistant_text("", None, [("f", {"xs": [], "o": {}}), ("g", {})])
    parsed = parse_pieces([text], OutputStart.EITHER, {"f": schema, "g": {}})
    assert parsed.arguments(0) == {"xs": [], "o": {}}
    assert parsed.calls[1]["arguments"] == "{}"


MALFORMED = [
    # (text, content given back, complete calls)
    (f"Hi {NS}<tool_call>\nno invoke here", f"Hi {NS}<tool_call>\nno invoke here", []),
    (f'{NS}<tool_call>\n{NS}<invoke name="search', f'{NS}<tool_call>\n{NS}<invoke name="search', []),
    (f'{NS}<tool_call>\n{NS}<invoke name="a\nb">', f'{NS}<tool_call>\n{NS}<invoke name="a\nb">', []),
    # A complete call, then garbage: the call stays, the garbage and the rest come back as text.
    (
        f'{NS}<tool_call>\n{NS}<invoke name="search">{NS}<query>x{NS}</query>{NS}</invoke>\n'
        f"GARBAGE{NS}</tool_call> end",
        f"\nGARBAGE{NS}</tool_call> end",
        [("search", {"query": "x"})],
    ),
    # An argument left open at the end: the call keeps what was read, the open argument comes back as text.
    (
        f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Rome{NS}</city>{NS}<days>4',
        f"{NS}<days>4",
        [("get_weather", {"city": "Rome"})],
    ),
    # A string argument cut off: it already streamed, so it ends where the output stopped (held tail included).
    (
        f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Ro',
        "",
        [("get_weather", {"city": "Ro"})],
    ),
    (
        f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Ro{NS}</ci',
        "",
        [("get_weather", {"city": f"Ro{NS}</ci"})],
    ),
    # One cut off before its text showed whether it is text or elements: it comes back as text.
    (
        f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city> ]<]mini',
        f"{NS}<city> ]<]mini",
        [("get_weather", {})],
    ),
    # A closing tag that matches no argument: the invoke breaks there.
    (
        f'{NS}<tool_call>\n{NS}<invoke name="search">{NS}</query>x{NS}</invoke>\n{NS}</tool_call>',
        f"{NS}</query>x{NS}</invoke>\n{NS}</tool_call>",
        [("search", {})],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), MALFORMED)
def test_malformed_blocks_come_back_as_text(text, content, calls):
    for pieces in every_split(text):
        parsed = parse_pieces(pieces, OutputStart.CONTENT, TOOLS)
        assert parsed.content == content
        assert [(call["name"], json.loads(call["arguments"])) for call in parsed.calls.values()] == calls


def test_a_malformed_block_inside_the_reasoning_goes_back_to_the_reasoning():
    parsed = parse_pieces([f"<mm:think>plan {NS}<tool_call>\nbroken</mm:think>answer"], OutputStart.EITHER, TOOLS)
    assert parsed.reasoning == f"plan {NS}<tool_call>\nbroken"
    assert parsed.content == "answer" and not parsed.calls
