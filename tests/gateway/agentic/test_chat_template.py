"""The tiny model's chat template renders tools, earlier tool calls, tool results and reasoning in M3's layout, as
transformers renders it too; thinking modes set the generation prompt."""

import pytest

from m3stack.engine.model.tiny_tokenizer import chat_template
from m3stack.gateway.agentic.tools import template_tool_calls
from m3stack.gateway.schemas import ToolCall
from m3stack.gateway.tokenize.chat_template import ChatTemplate

NS = "]<]minimax[>["
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]  # fmt: skip
CALLS = [
    ToolCall.model_validate({"id": "a", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Paris", "days": 2, "opt": null, '
                                                                  '"nested": {"hours": [6, {"m": true}]}}'}}),
    ToolCall.model_validate({"id": "b", "function": {"name": "get_weather", "arguments": "{}"}}),
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
     "tool_calls": template_tool_calls(CALLS, 2)},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "rain"}]},
    {"role": "assistant", "content": "Sunny, then rain."},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip
# M3's layout, written out: the developer turn holds the system message and the tools section; an assistant turn
# opens with its reasoning (or a bare </mm:think>), its calls are one block of invokes with arguments as elements
# (null left out, arrays as <item>, booleans as true/false); consecutive tool results share one turn.
EXPECTED = (
    "]~!b[]~b]system\nCurrent thinking mode: enabled.[e~[\n"
    "]~b]developer\nBe brief.\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n"
    '<tool>{"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}}}}</tool>\n</tools>\n\n'
    f"To call tools, wrap all invocations in a single {NS}<tool_call>{NS}</tool_call> block. Parameter values "
    "containing nested objects or arrays are recursively expanded into XML elements. Example:\n\n"
    f'{NS}<tool_call>\n{NS}<invoke name="tool-name-1">{NS}<param-1>value-1{NS}</param-1>{NS}<param-2>{NS}<item>'
    f"{NS}<key-a>val-a{NS}</key-a>{NS}<key-b>val-b{NS}</key-b>{NS}</item>{NS}</param-2>{NS}</invoke>\n"
    f'{NS}<invoke name="tool-name-2">{NS}<param-1>value-1{NS}</param-1>{NS}</invoke>\n{NS}</tool_call>[e~[\n'
    "]~b]user\nWeather?[e~[\n"
    f"]~b]ai\n<mm:think>Call the tool.</mm:think>{NS}<tool_call>\n"
    f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>{NS}<nested>{NS}<hours>'
    f"{NS}<item>6{NS}</item>{NS}<item>{NS}<m>true{NS}</m>{NS}</item>{NS}</hours>{NS}</nested>{NS}</invoke>\n"
    f'{NS}<invoke name="get_weather">{NS}</invoke>\n{NS}</tool_call>[e~[\n'
    "]~b]tool\n<response>sunny</response>\n<response>rain</response>[e~[\n"
    "]~b]ai\n</mm:think>Sunny, then rain.[e~[\n"
    "]~b]user\nThanks[e~[\n"
    "]~b]ai\n<mm:think>"
)


def test_an_agentic_conversation_renders_in_m3_layout():
    rendered = ChatTemplate(chat_template(), {}).render(
        CONVERSATION, tools=TOOLS, extra_variables={"thinking_mode": "enabled"}
    )
    assert rendered == EXPECTED


@pytest.mark.parametrize(("mode", "ending"), [("enabled", "<mm:think>"), ("disabled", "</mm:think>"),
                                              ("adaptive", ""), (None, "")])  # fmt: skip
def test_thinking_mode_sets_the_generation_prompt(mode, ending):
    variables = {"thinking_mode": mode} if mode else {}
    rendered = ChatTemplate(chat_template(), {}).render([{"role": "user", "content": "Hi"}], extra_variables=variables)
    assert rendered.endswith("]~b]user\nHi[e~[\n]~b]ai\n" + ending)
    assert f"Current thinking mode: {mode or 'adaptive'}." in rendered


def test_reasoning_written_inside_the_content_is_rendered_as_reasoning():
    message = {"role": "assistant", "content": "<mm:think>\nplan\n</mm:think>\n\nanswer"}
    rendered = ChatTemplate(chat_template(), {}).render([{"role": "user", "content": "q"}, message])
    assert "]~b]ai\n<mm:think>plan</mm:think>answer[e~[\n" in rendered


def test_transformers_renders_the_same(tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    for variables in ({"thinking_mode": "enabled"}, {"thinking_mode": "disabled"}, {}):
        ours = ChatTemplate(chat_template(), {}).render(CONVERSATION, tools=TOOLS, extra_variables=variables)
        theirs = hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                        **variables)  # fmt: skip
        assert ours == theirs
