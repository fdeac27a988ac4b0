"""A chat request's tools and ``tool_choice``, checked against each other (OpenAI's rules, 400s naming the field).

``auto`` (the default when tools are given) parses whatever calls the model makes; ``none`` leaves its output as
text; ``required`` (one call, or several with ``parallel_tool_calls``) and a named function (one call of it) force
calls by constrained decoding (``grammar.py``).  Assistant messages'
earlier calls go to the chat template with their arguments as objects, the form M3's template renders.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m3stack.gateway.errors import invalid_request
from m3stack.gateway.schemas import ChatCompletionRequest, NamedToolChoice, ToolCall


@dataclass(frozen=True)
class ToolPlan:
    schemas: dict[str, Any]  # tool name -> its parameters schema (None: none given)
    template_tools: list[dict[str, Any]]  # the tools as the chat template reads them
    parse_calls: bool  # whether calls in the output become tool_calls (not with tool_choice none)
    forced: tuple[str, ...]  # the tools a forced call may use; () when the model chooses
    parallel: bool  # whether a forced output may hold several calls (a named choice is one call, as vLLM's)


def tool_plan(request: ChatCompletionRequest) -> ToolPlan | None:
    choice = request.tool_choice
    if not request.tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise invalid_request("tool_choice forces a tool call, but the request has no tools", param="tool_choice")
        return None
    schemas: dict[str, Any] = {}
    for index, tool in enumerate(request.tools):
        name = tool.function.name
        if name in schemas:
            raise invalid_request(
                f"tools[{index}].function.name: {name!r} is the name of an earlier tool too",
                param=f"tools[{index}].function.name",
            )
        schemas[name] = tool.function.parameters
    forced: tuple[str, ...] = ()
    if choice == "required":
        forced = tuple(schemas)
    elif isinstance(choice, NamedToolChoice):
        if choice.function.name not in schemas:
            raise invalid_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(map(repr, schemas))})",
                param="tool_choice.function.name",
            )
        forced = (choice.function.name,)
    return ToolPlan(
        schemas=schemas,
        template_tools=[tool.model_dump(exclude_none=True) for tool in request.tools],
        parse_calls=choice != "none",
        forced=forced,
        parallel=request.parallel_tool_calls and not isinstance(choice, NamedToolChoice),
    )


def template_tool_calls(calls: Sequence[ToolCall], message_index: int) -> list[dict[str, Any]]:
    """An assistant message's calls as the template renders them: arguments as an object, null values left out
    (M3's template writes no null; its training never saw one)."""
    rendered = []
    for number, call in enumerate(calls):
        param = f"messages[{message_index}].tool_calls[{number}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except ValueError as exc:
            raise invalid_request(f"{param} is not valid JSON: {exc}", param=param) from exc
        if not isinstance(arguments, dict):
            raise invalid_request(f"{param} must be a JSON object", param=param)
        function = {"name": call.function.name, "arguments": _drop_nulls(arguments)}
        rendered.append({"id": call.id, "type": call.type, "function": function})
    return rendered


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_nulls(item) for item in value if item is not None]
    return value
