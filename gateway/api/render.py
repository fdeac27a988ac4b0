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

from m3stack.gateway.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprobEntry,
    UsageInfo,
)
from m3stack.gateway.generation.choice import ChoiceDelta, TokenLogprob
from m3stack.gateway.generation.run import Usage

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: str) -> bytes:
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


@dataclass
class _CompletionLogprobState:
    """Completion logprobs need each token's character offset in the choice's text."""

    text_offset: int = 0


def _completion_logprobs(
    token_text: Callable[[int], str], entries: Sequence[TokenLogprob], state: _CompletionLogprobState
) -> dict[str, Any]:
    tokens, offsets, top = [], [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        offsets.append(state.text_offset)
        state.text_offset += len(text)
        top.append({token_text(token_id): logprob for token_id, logprob in entry.top} or None)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


# ------------------------------------------------------------------------------------------------
# Streaming


class ChunkRenderer:
    """SSE events of one streamed request, chat or text completion."""

    def __init__(
        self, kind: str, meta: ResponseMeta, include_usage: bool, num_choices: int, echo_texts: Sequence[str] = ()
    ) -> None:
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
        self._logprob_states = [_CompletionLogprobState() for _ in range(num_choices)]
        self._echo = list(echo_texts)

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
            if text:
                self._logprob_states[index].text_offset = len(text)
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                events.append(sse_event(self._head + _dumps(choice) + self._tail))
        return b"".join(events)

    def delta(self, delta: ChoiceDelta) -> bytes:
        if not delta.text and delta.finish_reason is None and not (self._logprobs and delta.logprobs):
            return b""
        logprobs = "null"
        if self._chat:
            if self._logprobs:
                logprobs = _dumps({"content": [_chat_logprob_entry(self._token_text, e) for e in delta.logprobs]})
            content = f'"delta":{{"content":{_string(delta.text)}}}'
        else:
            if self._logprobs:
                state = self._logprob_states[delta.index]
                logprobs = _dumps(_completion_logprobs(self._token_text, delta.logprobs, state))
            content = f'"text":{_string(delta.text)}'
        if delta.finish_reason is None:
            finish = "null"
        else:
            finish = f'{_string(delta.finish_reason)},"stop_reason":{_dumps(delta.stop_reason)}'
        choice = f'{{"index":{delta.index},{content},"logprobs":{logprobs},"finish_reason":{finish}}}'
        return sse_event(self._head + choice + self._tail)

    def usage(self, usage: Usage) -> bytes:
        return sse_event(self._usage_head + usage_info(usage).model_dump_json() + "}")


# ------------------------------------------------------------------------------------------------
# Whole responses


@dataclass
class ChoiceAccumulator:
    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.pieces.append(delta.text)
        self.logprobs.extend(delta.logprobs)
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
                message=AssistantMessage(content="".join(choice.pieces)),
                logprobs=logprobs(choice),
                finish_reason=choice.finish_reason,  # type: ignore[arg-type]
                stop_reason=choice.stop_reason,
            )
            for choice in choices
        ],
    )


def completion_response(
    meta: ResponseMeta, choices: Sequence[ChoiceAccumulator], usage: Usage, echo_texts: Sequence[str]
) -> CompletionResponse:
    rendered = []
    for choice in choices:
        echo = echo_texts[choice.index] if echo_texts else ""
        choice_logprobs = None
        if meta.logprobs:
            state = _CompletionLogprobState(text_offset=len(echo))
            choice_logprobs = CompletionLogprobs(**_completion_logprobs(meta.token_text, choice.logprobs, state))
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
