"""One generation request inside the engine: its inputs, sampling settings, progress and state machine.

States (docs/engine.md#requests): ``WAITING -> (ENCODING) -> PREFILLING -> DECODING -> FINISHED | ABORTED``.
Preemption by recompute sends a running request back to ``WAITING`` with its KV freed; it keeps
its generated tokens and recomputes their KV (often from the prefix cache) when readmitted.
"""

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from m3stack.engine.runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    from m3stack.engine.runtime.grammar import RequestGrammar

# OpenAI's limit on top_logprobs; it also bounds the per-step top-k work in the sampler.
MAX_TOP_LOGPROBS = 20
# Stands for a token that a step in flight will sample (async scheduling); never a real token id.
PLACEHOLDER_TOKEN = -1
# OpenAI's ranges: logit_bias values in [-100, 100], presence and frequency penalties in [-2, 2]; the repetition
# penalty (no OpenAI field) gets (0, 2].
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    ENCODING = "encoding"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


_ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    # A resumed request whose cached prefix covers its whole prompt goes straight back to DECODING.
    RequestStatus.WAITING: frozenset(
        {
            RequestStatus.ENCODING,
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    # A short prompt can be encoded and fully prefilled in one step, so ENCODING may go straight to DECODING.
    RequestStatus.ENCODING: frozenset(
        {
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.WAITING,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.PREFILLING: frozenset(
        {
            RequestStatus.ENCODING,
            RequestStatus.DECODING,
            RequestStatus.WAITING,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.DECODING: frozenset({RequestStatus.WAITING, RequestStatus.FINISHED, RequestStatus.ABORTED}),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.ABORTED: frozenset(),
}


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # Abort, cancellation, drain deadline or a request-level error


class Modality(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings with the OpenAI defaults; ``validate`` checks them against the model."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None  # None = up to the context limit
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0  # OpenAI, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI, over generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM, over prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    prompt_logprobs: int | None = None  # None = off; n = also the n most likely tokens at each prompt position
    grammar: str | None = None  # llguidance Lark grammar constraining the generated tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token counts (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` naming the first bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidRequestError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must be in [0, 2**64), got {self.seed}")
        bad_stops = sorted(t for t in self.stop_token_ids if not 0 <= t < vocab_size)
        if bad_stops:
            raise InvalidRequestError(f"stop_token_ids {bad_stops[:8]} are outside the vocabulary [0, {vocab_size})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}"
            )
        self._validate_logit_bias(vocab_size)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidRequestError("grammar is empty")

    def _validate_logit_bias(self, vocab_size: int) -> None:
        bad_ids = sorted(token for token, _ in self.logit_bias if not 0 <= token < vocab_size)
        if bad_ids:
            raise InvalidRequestError(
                f"logit_bias token ids {bad_ids[:8]} are outside the vocabulary [0, {vocab_size})"
            )
        bad = [(token, bias) for token, bias in self.logit_bias if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS]
        if bad:  # NaN fails the comparison too
            token, bias = bad[0]
            raise InvalidRequestError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; token {token} has {bias}"
            )


@dataclass
class MultimodalInput:
    """One preprocessed image or video: patches, grid and where its embeddings go in the prompt."""

    modality: Modality
    content_hash: str
    pixel_values: torch.Tensor  # [num_patches, patch_dim] on the host: uint8 raw pixels or normalized floats
    grids: tuple[tuple[int, int, int], ...]  # (t, h, w) per vision segment
    placeholders: tuple[tuple[int, int], ...]  # sorted, disjoint (offset, length) prompt spans
    embed_positions: torch.Tensor  # [num_embeds] int64, sorted prompt positions receiving embeddings

    @property
    def num_embeds(self) -> int:
        return int(self.embed_positions.shape[0])

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of prompt positions the item touches (its first to last placeholder)."""
        first_offset = self.placeholders[0][0]
        last_offset, last_length = self.placeholders[-1]
        return first_offset, last_offset + last_length

    @property
    def first_embed(self) -> int:
        return int(self.embed_positions[0])

    @property
    def last_embed(self) -> int:
        return int(self.embed_positions[-1])


@dataclass
class SampledToken:
    """What the sampler returns for one request at one step."""

    token_id: int
    logprob: float | None = None
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..P-1 (token 0 has no context), and the top-n at each of those positions."""

    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)  # empty when n = 0


@dataclass
class RequestOutput:
    """New tokens of one request after a step, or its end (``finish_reason`` set)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    abort_message: str = ""
    prompt_logprobs: PromptLogprobs | None = None  # once, with the request's first token
    error: Exception | None = None  # an EngineError when the request failed (the stream ends with its status)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """Mutable progress of one request; owned by the scheduler thread."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        mm_inputs: Sequence[MultimodalInput] = (),
        cache_salt: str = "",
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("input_ids is empty")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens  # max_new_tokens resolved against the context limit
        self.eos_token_ids = frozenset() if sampling.ignore_eos else eos_token_ids
        self.mm_inputs = list(mm_inputs)
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # When the scheduler last admitted it from WAITING (monotonic; None while it has never run): the end of its
        # queue time, the start of its prefill (vLLM's SCHEDULED event; metrics and trace spans).
        self.scheduled_time: float | None = None
        # What came with it besides its inputs, as gRPC metadata (lower-case keys): the client's x-request-id and
        # W3C trace context (traceparent, tracestate).
        self.metadata: dict[str, str] = {}

        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        # Tokens whose K/V (and k-index) are in the paged cache.
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first admitted (reported as cached_tokens).
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Trailing placeholders in token_ids: tokens scheduled steps will sample (at most one per step in flight).
        self.num_pending_tokens = 0
        # Prefix-cache hash chain of every full block of token_ids (see prefix_cache.py).
        self.block_hashes: list[bytes] = []
        self.generator: torch.Generator | None = None  # per-request RNG when a seed is given
        self.grammar: RequestGrammar | None = None  # set by build_request when sampling.grammar is
        # Filled by the runner as prefill chunks run (sampling.prompt_logprobs); sent with the first token.
        self.prompt_logprobs = PromptLogprobs() if sampling.prompt_logprobs is not None else None
        self.prompt_logprobs_launched = 0  # the last prompt position a launched step computes the logprob of
        self.prompt_logprobs_sent = False

    # --- progress -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, counting those still being sampled."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Generated tokens whose ids are known (what the client has been sent, stop tokens included)."""
        return len(self.token_ids) - self.num_pending_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (the placeholders excluded)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens still missing from the cache: the prompt remainder, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    def append_placeholder(self) -> None:
        """Reserve the position of the token the step being scheduled will sample."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.num_pending_tokens += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """Fill the oldest placeholder with the token its step sampled."""
        if not self.num_pending_tokens:
            raise RuntimeError(f"{self}: a sampled token arrived for no pending position")
        self.token_ids[len(self.token_ids) - self.num_pending_tokens] = token_id
        self.num_pending_tokens -= 1

    # --- state machine --------------------------------------------------------------------------

    def transition(self, new_status: RequestStatus) -> None:
        if new_status is self.status:
            return
        if new_status not in _ALLOWED_TRANSITIONS[self.status]:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {new_status.name}")
        if self.status is RequestStatus.WAITING and new_status not in (RequestStatus.FINISHED, RequestStatus.ABORTED):
            self.scheduled_time = time.monotonic()
        self.status = new_status

    def finish(self, reason: FinishReason, stop_token_id: int | None = None) -> None:
        """End the request; placeholders of steps still in flight are dropped with it."""
        del self.token_ids[self.num_known_tokens :]
        self.num_pending_tokens = 0
        self.transition(RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED)
        self.finish_reason = reason
        self.stop_token_id = stop_token_id

    def __repr__(self) -> str:
        # The client's request id too: engine log lines about a request name the id the client and the gateway know.
        client_id = self.metadata.get("x-request-id")
        return (
            f"Request({self.request_id!r}{f' x-request-id={client_id!r}' if client_id else ''}, {self.status.name}, "
            f"prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
