"""ChoiceDeltas to OpenAI JSON: SSE chunks while streaming, one body otherwise.

Chunks are rendered by hand because this runs once per token per stream: a fixed head and tail
per request, and around them the choice as a format string whose only encoded part is the text
(``json.dumps`` builds an encoder per call); logprobs, rare, go through ``json.dumps``.  The shapes
are those of the pydantic models in ``schemas.py``.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _string  # a str as a JSON literal, as _dumps writes it
from typing import Any

from m3stack.gateway.agentic.output_parser import ToolCallDelta
from m3stack.gateway.generation.choice import ChoiceDelta, TokenLogprob
from m3stack.gateway.generation.run import Usage
from m3stack.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprobEntry,
    ToolCall,
    UsageInfo,
)

SSE_DONE = b"data: [DONE]\n\n"
# str.splitlines() (and so any client splitting a body with it) also ends lines at \v, \f, \x1c-\x1e, U+0085,
# U+2028 and U+2029.  JSON encoders escape the control characters among them but may leave the last three raw
# inside strings; as \u escapes the JSON means the same and every event stays on one line.
_ESCAPE_LINE_BREAKS = str.maketrans({char: f"\\u{ord(char):04x}" for char in "\x85\u2028\u2029"})


def sse_event(payload: str) -> bytes:
    """``payload`` (JSON) as one event.  ASCII payloads, most of them, skip the escaping (``isascii`` is O(1))."""
    if not payload.isascii():
        payload = payload.translate(_ESCAPE_LINE_BREAKS)
    return b"data: " + payload.encode() + b"\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk and body of one response repeats."""

    request_id: str
    model: str
    created: int
    token_text: Callable[[int], str]  # how logprobs name a token
    logprobs: bool


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def error_event(body: dict[str, Any]) -> bytes:
    return sse_event(_dumps(body))


# ------------------------------------------------------------------------------------------------
# Logprobs


def _chat_logprob_entry(token_text: Callable[[int], str], entry: TokenLogprob) -> dict[str, Any]:
    text = token_text(entry.token_id)
    return {
        "token": text,
        "logprob": entry.logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": (top := token_text(token_id)), "logprob": logprob, "bytes": list(top.encode())}
            for token_id, logprob in entry.top
        ],
    }


def _completion_logprobs(
    token_text: Callable[[int], str],
    entries: Sequence[TokenLogprob | None],
    text_start: int = 0,
    prompt_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """OpenAI's completion logprobs, offsets counted from ``text_start`` (the echoed prompt's length for generated
    tokens); a None entry (the first prompt token, with echo) is ``prompt_ids[i]`` at offset 0, with a null logprob."""
    return {
        "tokens": [token_text(e.token_id if e is not None else prompt_ids[i]) for i, e in enumerate(entries)],
        "token_logprobs": [e.logprob if e is not None else None for e in entries],
        "top_logprobs": [({token_text(t): logprob for t, logprob in e.top} or None) if e else None for e in entries],
        "text_offset": [text_start + (e.text_offset if e is not None else 0) for e in entries],
    }


# ------------------------------------------------------------------------------------------------
# Streaming


class ChunkRenderer:
    """SSE events of one streamed request, chat or text completion."""

    def __init__(
        self,
        kind: str,
        meta: ResponseMeta,
        include_usage: bool,
        num_choices: int,
        echo_texts: Sequence[str] = (),
        echo_prompt_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """``echo_prompt_ids``: with echo and logprobs, each choice's prompt (its logprobs come with the first tokens,
        and the echoed prompt with them)."""
        self._chat = kind == "chat"
        self._token_text = meta.token_text
        self._logprobs = meta.logprobs
        object_name = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = (
            f'{{"id":{_dumps(meta.request_id)},"object":"{object_name}","created":{meta.created},'
            f'"model":{_dumps(meta.model)},"choices":['
        )
        self._tail = '],"usage":null}' if include_usage else "]}"
        self._usage_head = self._head + '],"usage":'
        self._echo = list(echo_texts)
        self._echo_prompt_ids = list(echo_prompt_ids)

    def opening(self, num_choices: int) -> bytes:
        """Chat: the assistant role for every choice; completions with echo: the prompts."""
        if self._chat:
            choices = ",".join(
                f'{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}'
                for i in range(num_choices)
            )
            return sse_event(self._head + choices + self._tail)
        events = []
        for index, text in enumerate(self._echo):
            if text and not self._logprobs:  # with logprobs it goes out with them (``_echo_event``)
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                events.append(sse_event(self._head + _dumps(choice) + self._tail))
        return b"".join(events)

    def delta(self, delta: ChoiceDelta) -> bytes:
        echo = self._echo_event(delta)
        if (
            not delta.text
            and delta.finish_reason is None
            and not (self._logprobs and delta.logprobs)
            and not delta.reasoning
            and not delta.tool_calls
        ):
            return echo
        logprobs = "null"
        if self._chat:
            if self._logprobs:
                logprobs = _dumps({"content": [_chat_logprob_entry(self._token_text, e) for e in delta.logprobs]})
            content = f'"delta":{_chat_delta(delta)}'
        else:
            if self._logprobs:
                echoed = len(self._echo[delta.index]) if self._echo else 0
                logprobs = _dumps(_completion_logprobs(self._token_text, delta.logprobs, echoed))
            content = f'"text":{_string(delta.text)}'
        if delta.finish_reason is None:
            finish = "null"
        else:
            finish = f'{_string(delta.finish_reason)},"stop_reason":{_dumps(delta.stop_reason)}'
        choice = f'{{"index":{delta.index},{content},"logprobs":{logprobs},"finish_reason":{finish}}}'
        return echo + sse_event(self._head + choice + self._tail)

    def _echo_event(self, delta: ChoiceDelta) -> bytes:
        """Completions with echo and logprobs: the prompt and its logprobs, before the choice's first tokens."""
        if self._chat or not self._echo or not self._logprobs or delta.prompt_logprobs is None:
            return b""
        logprobs = _completion_logprobs(self._token_text, delta.prompt_logprobs, 0, self._echo_prompt_ids[delta.index])
        choice = {"index": delta.index, "text": self._echo[delta.index], "logprobs": logprobs, "finish_reason": None}
        return sse_event(self._head + _dumps(choice) + self._tail)

    def usage(self, usage: Usage) -> bytes:
        return sse_event(self._usage_head + usage_info(usage).model_dump_json() + "}")


def _chat_delta(delta: ChoiceDelta) -> str:
    """A chat chunk's delta: the content, and the reasoning and tool-call pieces when there are any."""
    if not delta.reasoning and not delta.tool_calls:
        return f'{{"content":{_string(delta.text)}}}'
    fields: dict[str, Any] = {}
    if delta.text:
        fields["content"] = delta.text
    if delta.reasoning:
        # Both names: the reference stacks' clients read reasoning_content, vLLM's current ones reasoning.
        fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
    if delta.tool_calls:
        fields["tool_calls"] = [_tool_call_piece(piece) for piece in _merged(delta.tool_calls)]
    return _dumps(fields)


def _merged(pieces: Sequence[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one (a chunk names each call once)."""
    merged: list[ToolCallDelta] = []
    for piece in pieces:
        if merged and merged[-1].index == piece.index and (piece.id is None or merged[-1].id is None):
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id or piece.id, last.name or piece.name,
                                       last.arguments + piece.arguments)  # fmt: skip
        else:
            merged.append(piece)
    return merged


def _tool_call_piece(piece: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed tool call: id, type and name in the call's first piece, then arguments text."""
    function: dict[str, Any] = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name, **function}
    if piece.id is None:
        return {"index": piece.index, "function": function}
    return {"index": piece.index, "id": piece.id, "type": "function", "function": function}


# ------------------------------------------------------------------------------------------------
# Whole responses


@dataclass
class ChoiceAccumulator:
    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallDelta] = field(default_factory=dict)  # by index, arguments joined

    def add(self, delta: ChoiceDelta) -> None:
        self.pieces.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            call = self.tool_calls.setdefault(piece.index, ToolCallDelta(piece.index))
            call.id = call.id or piece.id
            call.name = call.name or piece.name
            call.arguments += piece.arguments
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def chat_response(meta: ResponseMeta, choices: Sequence[ChoiceAccumulator], usage: Usage) -> ChatCompletionResponse:
    def logprobs(choice: ChoiceAccumulator) -> ChoiceLogprobs | None:
        if not meta.logprobs:
            return None
        return ChoiceLogprobs(
            content=[TokenLogprobEntry(**_chat_logprob_entry(meta.token_text, e)) for e in choice.logprobs]
        )

    return ChatCompletionResponse(
        id=meta.request_id,
        created=meta.created,
        model=meta.model,
        usage=usage_info(usage),
        choices=[
            ChatChoice(
                index=choice.index,
                message=_assistant_message(choice),
                logprobs=logprobs(choice),
                finish_reason=choice.finish_reason,  # type: ignore[arg-type]
                stop_reason=choice.stop_reason,
            )
            for choice in choices
        ],
    )


def _assistant_message(choice: ChoiceAccumulator) -> AssistantMessage:
    content = "".join(choice.pieces)
    calls = [
        ToolCall(id=call.id or "", function=FunctionCall(name=call.name or "", arguments=call.arguments))
        for _, call in sorted(choice.tool_calls.items())
    ]
    reasoning = "".join(choice.reasoning) or None
    return AssistantMessage(
        content=content if content or not calls else None,
        reasoning_content=reasoning,
        reasoning=reasoning,
        tool_calls=calls or None,
    )


def completion_response(
    meta: ResponseMeta,
    choices: Sequence[ChoiceAccumulator],
    usage: Usage,
    echo_texts: Sequence[str],
    echo_prompt_ids: Sequence[Sequence[int]] = (),
) -> CompletionResponse:
    """With echo and logprobs, each choice's logprobs start with its prompt's (``echo_prompt_ids``)."""
    rendered = []
    for choice in choices:
        echo = echo_texts[choice.index] if echo_texts else ""
        choice_logprobs = None
        if meta.logprobs:
            prompt: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo_prompt_ids and choice.prompt_logprobs is not None:
                prompt = _completion_logprobs(meta.token_text, choice.prompt_logprobs, 0, echo_prompt_ids[choice.index])
            generated = _completion_logprobs(meta.token_text, choice.logprobs, len(echo))
            choice_logprobs = CompletionLogprobs(**{key: prompt[key] + generated[key] for key in generated})
        rendered.append(
            CompletionChoice(
                index=choice.index,
                text=echo + "".join(choice.pieces),
                logprobs=choice_logprobs,
                finish_reason=choice.finish_reason,  # type: ignore[arg-type]
                stop_reason=choice.stop_reason,
            )
        )
    return CompletionResponse(
        id=meta.request_id, created=meta.created, model=meta.model, choices=rendered, usage=usage_info(usage)
    )
