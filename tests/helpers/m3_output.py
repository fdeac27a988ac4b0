"""M3-format model output, written by the tiny model's chat template (M3's own layout): what the model emits for an
assistant turn with reasoning, text and tool calls, and a parser run that collects OpenAI's parts."""

import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from m3stack.engine.model.tiny_tokenizer import chat_template
from m3stack.gateway.agentic.output_parser import OutputParser, OutputStart
from m3stack.gateway.tokenize.chat_template import ChatTemplate

ASSISTANT_OPEN = "]~b]ai\n"
TURN_END = "[e~[\n"


def m3_assistant_text(
    content: str = "", reasoning: str | None = None, calls: Iterable[tuple[str, Mapping[str, Any]]] = ()
) -> str:
    """The text of one assistant turn as M3 writes it (what its template renders for the turn, without the turn's
    opener and end): ``</mm:think>`` or ``<mm:think>REASONING</mm:think>``, the content, the tool-call block."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    tool_calls = [{"id": f"c{i}", "function": {"name": name, "arguments": dict(args)}} for i, (name, args) in
                  enumerate(calls)]  # fmt: skip
    if tool_calls:
        message["tool_calls"] = tool_calls
    template = ChatTemplate(chat_template(), {})
    rendered = template.render([{"role": "user", "content": "q"}, message], add_generation_prompt=False)
    turn = rendered[rendered.rindex(ASSISTANT_OPEN) + len(ASSISTANT_OPEN) :]
    assert turn.endswith(TURN_END)
    return turn[: -len(TURN_END)]


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> id, name, arguments (text)
    called: bool = False

    def arguments(self, index: int) -> Any:
        return json.loads(self.calls[index]["arguments"])


def parse_pieces(pieces: Iterable[str], start: OutputStart, tools: Mapping[str, Any] | None) -> Parsed:
    """Feed ``pieces`` one by one, then finish; ids are ``call_0``, ``call_1``... in order."""
    ids = itertools.count()
    parser = OutputParser(start, tools, lambda: f"call_{next(ids)}")
    parsed = Parsed()
    for result in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        parsed.content += result.content
        parsed.reasoning += result.reasoning
        for delta in result.tool_calls:
            call = parsed.calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = delta.id
            if delta.name is not None:
                call["name"] = delta.name
            call["arguments"] += delta.arguments
    parsed.called = parser.called
    return parsed
