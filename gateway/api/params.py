"""Request fields to the engine's sampling settings and requests, with the checks the schema cannot express."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from m3stack.gateway.engine_client.requests import EngineRequest, SamplingSettings
from m3stack.gateway.errors import invalid_request, not_supported
from m3stack.gateway.multimodal import PlacedItem
from m3stack.gateway.schemas import MAX_LOGIT_BIAS, ChatCompletionRequest, CompletionRequest, SamplingRequest

SEED_MODULUS = 2**64


@dataclass(frozen=True)
class OutputOptions:
    """What the gateway does with the tokens (the engine never sees these)."""

    stop_strings: tuple[str, ...]
    skip_special_tokens: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool = False  # completions with echo and logprobs: the prompt's, top_logprobs of them each


def reject_unsupported(request: SamplingRequest) -> None:
    """Known OpenAI fields we do not implement: fine at their neutral value, a 400 otherwise."""
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs and not request.logprobs:
        raise invalid_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise not_supported("suffix", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise not_supported("best_of other than n", "best_of")


def stop_strings(request: SamplingRequest) -> tuple[str, ...]:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(stop == "" for stop in stops):
        raise invalid_request("stop strings must not be empty", param="stop")
    return tuple(stops)


def output_options(request: ChatCompletionRequest | CompletionRequest) -> OutputOptions:
    if isinstance(request, ChatCompletionRequest):
        return OutputOptions(stop_strings(request), request.skip_special_tokens, request.logprobs,
                             request.top_logprobs or 0)  # fmt: skip
    logprobs = request.logprobs is not None
    return OutputOptions(stop_strings(request), request.skip_special_tokens, logprobs, request.logprobs or 0,
                         prompt_logprobs=logprobs and request.echo)  # fmt: skip


def requested_max_tokens(request: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            return request.max_completion_tokens, "max_completion_tokens"
        return request.max_tokens, "max_tokens"
    return request.max_tokens, "max_tokens"


def max_new_tokens(requested: int | None, param: str, prompt_tokens: int, context: int, prompt_param: str) -> int:
    """What the engine may generate: as requested, or up to the context; 400 when it cannot fit."""
    if prompt_tokens >= context:
        raise invalid_request(
            f"This model's maximum context length is {context} tokens, but the prompt has {prompt_tokens} tokens "
            "(no room left to generate). Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return context - prompt_tokens
    if prompt_tokens + requested > context:
        raise invalid_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the completion). "
            f"Reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(request: SamplingRequest, max_new: int, output: OutputOptions, vocab_size: int) -> SamplingSettings:
    """Engine settings shared by every choice of a prompt (``with_seed`` adds each choice's seed)."""
    stop_ids = tuple(request.stop_token_ids or [])
    if (bad := next((i for i in stop_ids if i >= vocab_size), None)) is not None:
        raise invalid_request(f"stop token id {bad} is outside the vocabulary (size {vocab_size})", "stop_token_ids")
    if request.min_tokens > max_new:
        raise invalid_request(
            f"min_tokens ({request.min_tokens}) exceeds the tokens that may be generated ({max_new})",
            param="min_tokens",
        )
    repetition = request.repetition_penalty
    return SamplingSettings(
        max_new_tokens=max_new,
        stop_token_ids=stop_ids,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        # Zero and off are sent as unset, which the engine reads the same.
        min_new_tokens=request.min_tokens or None,
        ignore_eos=True if request.ignore_eos else None,
        logprobs=True if output.logprobs else None,
        top_logprobs=(output.top_logprobs or None) if output.logprobs else None,
        prompt_logprobs=output.top_logprobs if output.prompt_logprobs else None,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
        repetition_penalty=repetition if repetition is not None and repetition != 1.0 else None,
        logit_bias=tuple(logit_bias(request, vocab_size).items()),
    )


def logit_bias(request: SamplingRequest, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as ids; 400 naming the first bad entry."""
    biases: dict[int, float] = {}
    for key, bias in (request.logit_bias or {}).items():
        if not key.strip().isdecimal():
            raise invalid_request(f"logit_bias key {key!r} is not a token id (a non-negative integer)", "logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise invalid_request(
                f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})", "logit_bias"
            )
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid_request(
                f"logit_bias value {bias} for token {token_id} is outside [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
                "logit_bias",
            )
        biases[token_id] = bias
    return biases


def with_seed(settings: SamplingSettings, seed: int | None, choice_index: int) -> SamplingSettings:
    """Choice i of a seeded request samples with seed + i, so n choices differ yet repeat exactly."""
    if seed is None:
        return settings
    return replace(settings, seed=(seed + choice_index) % SEED_MODULUS)


def engine_requests(
    request_id: str,
    prompt_ids: Sequence[int],
    mm_items: Sequence[PlacedItem],
    settings: SamplingSettings,
    request: SamplingRequest,
    first_choice_index: int,
    metadata: Mapping[str, str],
) -> list[EngineRequest]:
    """One engine request per choice; ``metadata``: the client's request id and trace context."""
    return [
        EngineRequest(
            request_id=f"{request_id}-{first_choice_index + i}",
            input_ids=prompt_ids,
            sampling=with_seed(settings, request.seed, i),
            mm_items=mm_items,
            cache_salt=request.cache_salt or "",
            priority=request.priority,
            metadata=metadata,
        )
        for i in range(request.n)
    ]
