"""What an engine stream says, in the gateway's own types: ``wire.read_response`` reads engine.proto into them.

A stream is ``TokenChunk``s (usually one token each) and then one ``Completion``.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# UNSPECIFIED reads as "stop", as a completion without a reason ends like one.
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class TopTokens:
    """The most likely tokens at one position, most likely first."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens 1..P-1 (token 0 has no context), and the top tokens at each of those positions."""

    logprobs: Sequence[float]
    top: Sequence[TopTokens]  # empty when no top tokens were asked for


@dataclass(frozen=True, slots=True)
class TokenChunk:
    token_ids: Sequence[int]  # new since the previous chunk
    cached_tokens: int  # prompt tokens the engine found in its prefix cache
    logprobs: Sequence[float] = ()  # one per token when asked for
    top_logprobs: Sequence[TopTokens] = ()
    prompt_logprobs: PromptLogprobs | None = None  # only in the first chunk, when asked for


@dataclass(frozen=True, slots=True)
class Completion:
    finish_reason: FinishReason
    completion_tokens: int  # what the engine generated, a final EOS or stop token it did not send included
    cached_tokens: int
    matched_stop_token_id: int | None = None  # the stop or EOS token that ended it
    abort_message: str = ""


EngineEvent = TokenChunk | Completion
