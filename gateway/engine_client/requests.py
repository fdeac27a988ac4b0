"""What the gateway asks an engine for, in its own types: ``wire`` turns them into engine.proto messages.

Every optional setting is ``None`` when unset: the engine then applies the OpenAI default, so "unset" and "zero"
stay apart as the contract wants them (a temperature of 0 is greedy, an unset one is 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the pipeline imports the image and video codecs (simplejpeg, PyAV), which an
    # engine-side client such as the serving benchmark on the GPU machine neither has nor needs
    from m3stack.gateway.multimodal.pipeline import PlacedItem


@dataclass(frozen=True)
class SamplingSettings:
    """One engine request's sampling (engine.proto ``SamplingParams``)."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    min_new_tokens: int | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Set (even to 0): every prompt token's logprob, and this many most likely tokens at each position.
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), in the request's order
    grammar: str | None = None  # llguidance Lark constraining the generated tokens


@dataclass(frozen=True)
class EngineRequest:
    """One choice of one prompt, as one engine request (engine.proto ``GenerateRequest``)."""

    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingSettings
    mm_items: Sequence[PlacedItem] = ()
    cache_salt: str = ""
    priority: int = 0
    # The client's request id ("x-request-id") and the W3C trace context, for the engine's logs and spans.
    metadata: Mapping[str, str] = field(default_factory=dict)
