"""engine.proto on the gateway's side: requests built from ``requests``' types, responses read into ``events``'.

This is the one gateway module that builds or reads engine.proto messages (the import contract keeps every gateway
package but this one off ``m3stack.proto``); ``client`` and ``shared_stream`` carry what it builds.  A multimodal
item's patches travel inline in the message, or, when its transport says so, in a shared-memory segment written
here that the engine reads and unlinks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from m3stack.gateway.engine_client.events import (
    Completion,
    EngineEvent,
    FinishReason,
    PromptLogprobs,
    TokenChunk,
    TopTokens,
)
from m3stack.gateway.engine_client.requests import EngineRequest, SamplingSettings
from m3stack.gateway.multimodal.transport import (
    Transport,
    WireDType,
    new_segment_name,
    write_segment,
)
from m3stack.proto import engine_pb2

if TYPE_CHECKING:  # the pipeline imports the image and video codecs (simplejpeg, PyAV), which an
    # engine-side client such as the serving benchmark on the GPU machine neither has nor needs
    from m3stack.gateway.multimodal.pipeline import PlacedItem

# SamplingSettings fields sent only when set, under the same name in SamplingParams.
_OPTIONAL_SETTINGS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "min_new_tokens", "ignore_eos", "logprobs", "top_logprobs",
    "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
_DTYPES = {WireDType.UINT8: engine_pb2.DTYPE_UINT8, WireDType.BFLOAT16: engine_pb2.DTYPE_BFLOAT16}
_MODALITIES = {"image": engine_pb2.MODALITY_IMAGE, "video": engine_pb2.MODALITY_VIDEO}
_FINISH_REASONS: dict[int, FinishReason] = {
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}

# --- requests ---------------------------------------------------------------------------------


def generate_request(request: EngineRequest) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request.request_id,
        input_ids=request.input_ids,
        mm_items=[multimodal_item(item) for item in request.mm_items],
        sampling=sampling_params(request.sampling),
        cache_salt=request.cache_salt,
        priority=request.priority,
        metadata=request.metadata,
    )


def sampling_params(settings: SamplingSettings) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(max_new_tokens=settings.max_new_tokens, stop_token_ids=settings.stop_token_ids)
    for name in _OPTIONAL_SETTINGS:
        if (value := getattr(settings, name)) is not None:
            setattr(params, name, value)
    for token_id, bias in settings.logit_bias:
        params.logit_bias[token_id] = bias
    if settings.grammar is not None:
        params.grammar.lark = settings.grammar
    return params


def multimodal_item(placed: PlacedItem) -> engine_pb2.MultimodalItem:
    item = placed.item
    return engine_pb2.MultimodalItem(
        modality=_MODALITIES[item.modality],
        pixel_values=tensor(item.payload, item.shape, placed.transport),
        grids=[engine_pb2.VisionGrid(t=t, h=h, w=w) for t, h, w in item.plan.grids],
        placeholders=[engine_pb2.PlaceholderRange(offset=s.offset, length=s.length) for s in placed.placeholders],
        content_hash=item.content_hash,
    )


def tensor(payload: bytes, shape: tuple[int, ...], transport: Transport) -> engine_pb2.Tensor:
    """A Tensor carrying ``payload`` inline, or in a fresh segment the engine takes ownership of."""
    message = engine_pb2.Tensor(shape=list(shape), dtype=_DTYPES[transport.dtype])
    threshold = transport.shm_threshold_bytes
    if threshold is not None and len(payload) >= threshold:
        name = new_segment_name()
        write_segment(name, payload)
        message.shm.CopyFrom(engine_pb2.ShmHandle(name=name, offset=0, nbytes=len(payload)))
    else:
        message.inline_data = payload
    return message


# --- responses --------------------------------------------------------------------------------


def read_response(response: engine_pb2.GenerateResponse) -> EngineEvent:
    """A chunk or the completion (a ``GenerateStream`` error never gets here: ``shared_stream`` raises it)."""
    if response.HasField("complete"):
        complete = response.complete
        stop_id = complete.matched_stop_token_id if complete.HasField("matched_stop_token_id") else None
        return Completion(_FINISH_REASONS.get(complete.finish_reason, "stop"), complete.completion_tokens,
                          complete.cached_tokens, stop_id, complete.abort_message)  # fmt: skip
    chunk = response.chunk
    # Nearly every chunk is one token without logprobs: the repeated fields are handed on as they are.
    return TokenChunk(
        chunk.token_ids,
        chunk.cached_tokens,
        chunk.logprobs,
        _top_tokens(chunk.top_logprobs) if chunk.top_logprobs else (),
        _prompt_logprobs(chunk.prompt_logprobs) if chunk.HasField("prompt_logprobs") else None,
    )


def _top_tokens(entries: Iterable[engine_pb2.TopLogprobs]) -> tuple[TopTokens, ...]:
    return tuple(TopTokens(entry.token_ids, entry.logprobs) for entry in entries)


def _prompt_logprobs(message: engine_pb2.PromptLogprobs) -> PromptLogprobs:
    return PromptLogprobs(message.logprobs, _top_tokens(message.top_logprobs))
