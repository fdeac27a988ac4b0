"""A chat request's agentic fields, checked before any work: 400s that name the field, and what the plan asks of the
template, the parser and the engine."""

import pytest

from m3stack.gateway.agentic.chat_plan import plan_chat
from m3stack.gateway.agentic.grammar import LarkWriter
from m3stack.gateway.agentic.output_parser import OutputParser, OutputStart
from m3stack.gateway.agentic.tools import template_tool_calls
from m3stack.gateway.errors import APIError
from m3stack.gateway.schemas import ChatCompletionRequest, ToolCall
from tests.helpers.m3_output import parse_pieces

NAMED_G = {"type": "function", "function": {"name": "g"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q"}], **fields}
    )


def refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": NAMED_G, "tools": [TOOL]}, "tool_choice.function.name"),
        ({"tool_choice": NAMED_G}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        ({"chat_template_kwargs": {"thinking_mode": "sometimes"}}, "chat_template_kwargs.thinking_mode"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_agentic_fields_are_400s_naming_them(fields, param):
    assert refusal(lambda: plan_chat(request(**fields), "adaptive")).param == param


def test_a_forced_call_of_a_tool_whose_schema_cannot_be_enforced_is_a_400(tokenizer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}}}  # fmt: skip
    plan = plan_chat(request(tools=[tool], tool_choice="required"), "adaptive")
    error = refusal(lambda: plan.grammar("]~b]ai\n", LarkWriter(tokenizer.special_token_ids)))
    assert error.param == "tools[0].function.parameters.properties.when" and "format" in error.message
    # The model choosing (auto) sends no grammar: the schema is only read to type the arguments.
    assert plan_chat(request(tools=[tool]), "adaptive").grammar("]~b]ai\n", LarkWriter({})) is None


def test_thinking_mode_comes_from_the_request_or_the_deployment():
    assert plan_chat(request(), "disabled").thinking_mode == "disabled"
    assert plan_chat(request(chat_template_kwargs={"enable_thinking": True}), "disabled").thinking_mode == "enabled"
    plan = plan_chat(request(chat_template_kwargs={"thinking_mode": "disabled", "x": 1}), "enabled")
    assert plan.template_variables({"x": 1}) == {"x": 1, "thinking_mode": "disabled"}


def test_no_parser_when_the_output_is_plain_text():
    assert plan_chat(request(), "disabled").output_parser("]~b]ai\n</mm:think>", frozenset()) is None
    assert plan_chat(request(tools=[TOOL], tool_choice="none"), "x").output_parser("</mm:think>", frozenset()) is None
    assert plan_chat(request(), "adaptive").output_parser("]~b]ai\n", frozenset()) is not None


def test_earlier_call_arguments_must_be_a_json_object():
    for arguments in ("{not json", "[1, 2]"):
        call = ToolCall.model_validate({"id": "a", "function": {"name": "f", "arguments": arguments}})
        error = refusal(lambda call=call: template_tool_calls([call], 3))
        assert error.param == "messages[3].tool_calls[0].function.arguments"


def test_markers_the_client_would_not_see_are_left_out_of_the_text():
    """With skip_special_tokens the parser reads the think markers but hands on text without them, as decoding
    without markers would have."""
    hidden = frozenset({"<mm:think>", "</mm:think>"})
    parser = OutputParser(OutputStart.EITHER, None, lambda: "id", hidden)
    pieces = ["Hello <mm:th", "ink> there</mm:", "think>!"]
    text = "".join(parser.feed(piece).content for piece in pieces) + parser.finish().content
    assert text == "Hello  there!"
    assert parse_pieces(pieces, OutputStart.EITHER, None).content == "Hello <mm:think> there</mm:think>!"
