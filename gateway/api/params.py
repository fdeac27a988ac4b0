"""Request fields to engine ``SamplingParams``, with the checks the schema cannot express."""

from collections.abc import Sequence
from dataclasses import dataclass

from m3stack.engine.proto import engine_pb2
from m3stack.gateway.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from m3stack.gateway.errors import invalid_request, not_supported

SEED_MODULUS = 2**64


@dataclass(frozen=True)
class OutputOptions:
    """What the gateway does with the tokens (the engine never sees these)."""

    stop_strings: tuple[str, ...]
    skip_special_tokens: bool
    logprobs: bool
    top_logprobs: int


def reject_unsupported(request: SamplingRequest) -> None:
    """Known OpenAI fields we do not implement: fine at their neutral value, a 400 otherwise."""
    if request.presence_penalty:
        raise not_supported("presence_penalty other than 0", "presence_penalty")
    if request.frequency_penalty:
        raise not_supported("frequency_penalty other than 0", "frequency_penalty")
    if request.logit_bias:
        raise not_supported("logit_bias", "logit_bias")
    if isinstance(request, ChatCompletionRequest):
        if request.tools:
            raise not_supported("tools (function calling)", "tools")
        if request.tool_choice not in (None, "none", "auto"):
            raise not_supported("tool_choice other than 'none'", "tool_choice")
        if request.response_format is not None and request.response_format.get("type", "text") != "text":
            raise not_supported("response_format other than {'type': 'text'}", "response_format")
        if request.top_logprobs and not request.logprobs:
            raise invalid_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise not_supported("suffix", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise not_supported("best_of other than n", "best_of")
        if request.echo and request.logprobs is not None:
            raise not_supported("echo with logprobs (prompt logprobs)", "echo")


def stop_strings(request: SamplingRequest) -> tuple[str, ...]:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(stop == "" for stop in stops):
        raise invalid_request("stop strings must not be empty", param="stop")
    return tuple(stops)


def output_options(request: ChatCompletionRequest | CompletionRequest) -> OutputOptions:
    if isinstance(request, ChatCompletionRequest):
        logprobs, top = request.logprobs, request.top_logprobs or 0
    else:
        logprobs, top = request.logprobs is not None, request.logprobs or 0
    return OutputOptions(stop_strings(request), request.skip_special_tokens, logprobs, top)


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


def sampling_params(
    request: SamplingRequest, max_new: int, output: OutputOptions, vocab_size: int
) -> engine_pb2.SamplingParams:
    """Engine parameters shared by every choice of a prompt (``with_seed`` adds each choice's seed)."""
    stop_ids = list(request.stop_token_ids or [])
    if (bad := next((i for i in stop_ids if i >= vocab_size), None)) is not None:
        raise invalid_request(f"stop token id {bad} is outside the vocabulary (size {vocab_size})", "stop_token_ids")
    if request.min_tokens > max_new:
        raise invalid_request(
            f"min_tokens ({request.min_tokens}) exceeds the tokens that may be generated ({max_new})",
            param="min_tokens",
        )
    params = engine_pb2.SamplingParams(max_new_tokens=max_new, stop_token_ids=stop_ids)
    if request.temperature is not None:
        params.temperature = request.temperature
    if request.top_p is not None:
        params.top_p = request.top_p
    if request.top_k is not None:
        params.top_k = request.top_k
    if request.min_p is not None:
        params.min_p = request.min_p
    if request.min_tokens:
        params.min_new_tokens = request.min_tokens
    if request.ignore_eos:
        params.ignore_eos = True
    if output.logprobs:
        params.logprobs = True
        if output.top_logprobs:
            params.top_logprobs = output.top_logprobs
    return params


def with_seed(params: engine_pb2.SamplingParams, seed: int | None, choice_index: int) -> engine_pb2.SamplingParams:
    """Choice i of a seeded request samples with seed + i, so n choices differ yet repeat exactly."""
    if seed is None:
        return params
    seeded = engine_pb2.SamplingParams()
    seeded.CopyFrom(params)
    seeded.seed = (seed + choice_index) % SEED_MODULUS
    return seeded


def engine_requests(
    request_id: str,
    prompt_ids: Sequence[int],
    mm_items: Sequence[engine_pb2.MultimodalItem],
    params: engine_pb2.SamplingParams,
    request: SamplingRequest,
    first_choice_index: int,
) -> list[engine_pb2.GenerateRequest]:
    return [
        engine_pb2.GenerateRequest(
            request_id=f"{request_id}-{first_choice_index + i}",
            input_ids=prompt_ids,
            mm_items=mm_items,
            sampling=with_seed(params, request.seed, i),
            cache_salt=request.cache_salt or "",
            priority=request.priority,
        )
        for i in range(request.n)
    ]
