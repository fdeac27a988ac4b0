"""What the agentic fields of one chat request ask of the pipeline: template variables, the output parser, the
grammar sent to the engine.

Built before the prompt (the fields are checked first, so a bad request costs no templating); the parser and the
grammar need where the model's output starts, which the rendered prompt tells (``output_start``).
"""

import functools
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llguidance

from m3stack.gateway.agentic.grammar import GrammarError, LarkWriter, json_grammar, tool_call_grammar
from m3stack.gateway.agentic.output_parser import OutputParser, OutputStart, output_start
from m3stack.gateway.agentic.reasoning import THINKING_MODE_VARIABLE, thinking_mode
from m3stack.gateway.agentic.tools import ToolPlan, tool_plan
from m3stack.gateway.errors import invalid_request
from m3stack.gateway.schemas import ChatCompletionRequest, JsonObjectResponseFormat, JsonSchemaResponseFormat

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ChatPlan:
    tools: ToolPlan | None
    thinking_mode: str
    response_schema: dict[str, Any] | None  # the JSON the output must be (json_object: any object)

    def template_variables(self, request_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        return {**(request_kwargs or {}), THINKING_MODE_VARIABLE: self.thinking_mode}

    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools.template_tools if self.tools is not None else None

    def output_parser(self, prompt_text: str, hidden: frozenset[str]) -> OutputParser | None:
        """A parser for one choice's output; None when there is nothing to parse (plain text).  ``hidden``: the
        markers the client's decoding drops (``OutputParser``)."""
        start = output_start(prompt_text)
        parse_calls = self.tools is not None and self.tools.parse_calls
        if start is OutputStart.CONTENT and not parse_calls:
            return None
        schemas = self.tools.schemas if parse_calls and self.tools is not None else None
        return OutputParser(start, schemas, new_call_id, hidden)

    def grammar(self, prompt_text: str, writer: LarkWriter) -> str | None:
        """The Lark grammar constraining the output, or None (free output)."""
        start = output_start(prompt_text)
        tools = self.tools
        try:
            if tools is not None and tools.forced:
                chosen = [(name, tools.schemas[name]) for name in tools.forced]
                return tool_call_grammar(chosen, tools.parallel, start, writer, "tools")
            if self.response_schema is None:
                return None
            if tools is not None and tools.parse_calls:  # a JSON answer, or calls of any tool
                return tool_call_grammar(
                    list(tools.schemas.items()), tools.parallel, start, writer, "tools", or_json=self.response_schema
                )
            return json_grammar(self.response_schema, start, writer)
        except GrammarError as exc:
            raise invalid_request(str(exc), param=exc.param, code="unsupported_schema") from exc


def plan_chat(request: ChatCompletionRequest, default_thinking_mode: str) -> ChatPlan:
    schema = None
    response_format = request.response_format
    if isinstance(response_format, JsonObjectResponseFormat):
        schema = ANY_JSON_OBJECT
    elif isinstance(response_format, JsonSchemaResponseFormat):
        schema = response_format.json_schema.json_schema or ANY_JSON_OBJECT
        check_json_schema(json.dumps(schema, sort_keys=True), "response_format.json_schema.schema")
    return ChatPlan(tool_plan(request), thinking_mode(default_thinking_mode, request.chat_template_kwargs), schema)


@functools.lru_cache(maxsize=256)
def check_json_schema(schema_json: str, param: str) -> None:
    """A 400 naming what llguidance (the engine's grammar engine) cannot enforce in the schema, before the request
    reaches an engine."""
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema_json))
    if error:
        raise invalid_request(f"{param} cannot be enforced: {error}", param=param, code="unsupported_schema")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
