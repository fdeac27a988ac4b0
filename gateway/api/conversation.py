"""What makes a list of chat messages a conversation the model can be asked to continue: OpenAI's rules, in
this one module (the chat route calls ``check_conversation`` before anything is templated or fetched).

* system, developer, user and tool messages have content (a string, or a non-empty array of parts);
  images and videos appear only in user messages;
* an assistant message has content or ``tool_calls``; only assistant messages make tool calls, each call
  with an id unique in the conversation;
* a tool message names, in ``tool_call_id``, a call of the assistant message it follows (tool messages
  only in between), and answers it once;
* every call of an assistant message is answered by the tool messages right after it.

Every refusal is a 400 whose ``param`` is the field at fault (``messages[2].tool_call_id``).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from m3stack.gateway.errors import APIError, invalid_request
from m3stack.gateway.schemas import ChatMessage, TextPart

ROLES_WITH_REQUIRED_CONTENT = frozenset({"system", "developer", "user", "tool"})


@dataclass
class _OpenCalls:
    """The tool calls of the assistant message that the tool messages after it answer."""

    message_index: int
    call_ids: list[str]
    answered: dict[str, int] = field(default_factory=dict)  # call id -> index of the tool message

    def unanswered(self) -> list[str]:
        return [call_id for call_id in self.call_ids if call_id not in self.answered]


def check_conversation(messages: Sequence[ChatMessage]) -> None:
    """Raise a 400 naming the first field that breaks a rule above."""
    open_calls: _OpenCalls | None = None
    seen_call_ids: dict[str, str] = {}
    for index, message in enumerate(messages):
        _check_content(index, message)
        if message.role != "tool" and open_calls is not None:
            _require_all_answered(open_calls)
            open_calls = None
        if message.role == "assistant":
            open_calls = _check_assistant(index, message, seen_call_ids)
        elif message.tool_calls:
            raise _refuse(index, "tool_calls", f"only assistant messages make tool calls, not {message.role} messages")
        if message.role == "tool":
            _check_tool_answer(index, message, open_calls)
    if open_calls is not None:
        _require_all_answered(open_calls)


def _check_content(index: int, message: ChatMessage) -> None:
    content = message.content
    if content is None:
        if message.role in ROLES_WITH_REQUIRED_CONTENT:
            raise _refuse(index, "content", f"a {message.role} message needs content (a string or an array of parts)")
        return
    if isinstance(content, list):
        if not content:
            raise _refuse(index, "content", "an empty array: give a string or at least one content part")
        if message.role != "user":
            media = next((p for p, part in enumerate(content) if not isinstance(part, TextPart)), None)
            if media is not None:
                raise _refuse(
                    index,
                    f"content[{media}]",
                    f"{message.role} messages take text parts only; images and videos go in user messages",
                )


def _check_assistant(index: int, message: ChatMessage, seen_call_ids: dict[str, str]) -> _OpenCalls | None:
    if message.tool_calls is None:
        if message.content is None:
            raise _refuse(index, "content", "an assistant message needs content or tool_calls")
        return None
    if not message.tool_calls:
        raise _refuse(index, "tool_calls", "an empty array: leave tool_calls out or give at least one call")
    call_ids = []
    for number, call in enumerate(message.tool_calls):
        where = f"messages[{index}].tool_calls[{number}]"
        if not call.id:
            raise _refuse(index, f"tool_calls[{number}].id", "a tool call needs an id")
        if call.id in seen_call_ids:
            raise _refuse(
                index, f"tool_calls[{number}].id", f"{call.id!r} is already the id of {seen_call_ids[call.id]}"
            )
        seen_call_ids[call.id] = where
        call_ids.append(call.id)
    return _OpenCalls(index, call_ids)


def _check_tool_answer(index: int, message: ChatMessage, open_calls: _OpenCalls | None) -> None:
    if not message.tool_call_id:
        raise _refuse(index, "tool_call_id", "a tool message needs the id of the tool call it answers")
    if open_calls is None:
        raise _refuse(
            index,
            "tool_call_id",
            f"{message.tool_call_id!r} answers no call: a tool message must follow an assistant message with "
            "tool_calls (only other tool messages in between)",
        )
    if message.tool_call_id not in open_calls.call_ids:
        calls = ", ".join(repr(call_id) for call_id in open_calls.call_ids)
        raise _refuse(
            index,
            "tool_call_id",
            f"{message.tool_call_id!r} is not a call of messages[{open_calls.message_index}] (its calls: {calls})",
        )
    if (earlier := open_calls.answered.get(message.tool_call_id)) is not None:
        raise _refuse(index, "tool_call_id", f"{message.tool_call_id!r} was already answered by messages[{earlier}]")
    open_calls.answered[message.tool_call_id] = index


def _require_all_answered(open_calls: _OpenCalls) -> None:
    missing = open_calls.unanswered()
    if missing:
        raise _refuse(
            open_calls.message_index,
            "tool_calls",
            f"every tool call needs a tool message answering it right after the assistant message; "
            f"{', '.join(repr(call_id) for call_id in missing)} {'has' if len(missing) == 1 else 'have'} none",
        )


def _refuse(index: int, field_path: str, reason: str) -> APIError:
    param = f"messages[{index}].{field_path}"
    return invalid_request(f"{param}: {reason}", param=param, code="invalid_value")
