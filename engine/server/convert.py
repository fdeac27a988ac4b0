"""engine.proto messages <-> runtime types: sampling settings, tensors (inline or shared memory), outputs.

Tensor payloads are checked before any byte is interpreted: a known dtype, a positive shape whose
size matches the payload exactly and stays under the engine's limit, and for shared memory a plain
segment name under /dev/shm with the range inside the segment.  The engine unlinks every segment it
was handed, read or rejected, so a bad request leaks nothing.
"""

import contextlib
import hashlib
import math
import os
import re
from pathlib import Path

import torch

from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.request import FinishReason, Modality, RequestOutput, SamplingParams
from m3stack.engine.runtime.validation import MultimodalSpec
from m3stack.proto import engine_pb2 as pb

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")

_DTYPES = {
    pb.DTYPE_UINT8: torch.uint8,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_FLOAT32: torch.float32,
}
_MODALITIES = {pb.MODALITY_IMAGE: Modality.IMAGE, pb.MODALITY_VIDEO: Modality.VIDEO}
_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take the OpenAI defaults (engine.proto)."""

    def get(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        temperature=float(get("temperature", 1.0)),
        top_p=float(get("top_p", 1.0)),
        top_k=int(get("top_k", 0)),
        min_p=float(get("min_p", 0.0)),
        seed=get("seed", None),
        max_new_tokens=get("max_new_tokens", None),
        min_new_tokens=int(get("min_new_tokens", 0)),
        stop_token_ids=frozenset(message.stop_token_ids),
        ignore_eos=bool(get("ignore_eos", False)),
        logprobs=bool(get("logprobs", False)),
        top_logprobs=int(get("top_logprobs", 0)),
        presence_penalty=float(get("presence_penalty", 0.0)),
        frequency_penalty=float(get("frequency_penalty", 0.0)),
        repetition_penalty=float(get("repetition_penalty", 1.0)),
        logit_bias=tuple(sorted((int(token), float(bias)) for token, bias in message.logit_bias.items())),
        prompt_logprobs=get("prompt_logprobs", None),
        grammar=_grammar_text(message),
    )


def _grammar_text(message: pb.SamplingParams) -> str | None:
    if not message.HasField("grammar"):
        return None
    kind = message.grammar.WhichOneof("kind")
    if kind != "lark":
        raise InvalidRequestError("grammar has no kind set (expected grammar.lark)")
    return message.grammar.lark


def tensor_from_proto(message: pb.Tensor, where: str, max_bytes: int) -> torch.Tensor:
    """A host tensor from an inline or shared-memory payload; ``InvalidRequestError`` on any inconsistency."""
    payload = message.WhichOneof("payload")
    shm_name = message.shm.name if payload == "shm" else None
    try:
        dtype = _DTYPES.get(message.dtype)
        if dtype is None:
            raise InvalidRequestError(f"{where}.dtype is unspecified or unknown ({message.dtype})")
        shape = [int(d) for d in message.shape]
        if not shape or any(d <= 0 for d in shape):
            raise InvalidRequestError(f"{where}.shape must be non-empty with positive sizes, got {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if nbytes > max_bytes:
            raise InvalidRequestError(f"{where} has {nbytes} bytes, over the engine's limit of {max_bytes}")
        if payload == "inline_data":
            data = message.inline_data
            if len(data) != nbytes:
                raise InvalidRequestError(f"{where}.inline_data has {len(data)} bytes; shape {shape} needs {nbytes}")
            buffer = bytearray(data)
        elif payload == "shm":
            buffer = _read_shm(message.shm, nbytes, where)
        else:
            raise InvalidRequestError(f"{where} carries no payload (inline_data or shm)")
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
    finally:
        if shm_name is not None and _SHM_NAME.match(shm_name) and shm_name not in (".", ".."):
            with contextlib.suppress(OSError):
                os.unlink(SHM_DIR / shm_name)


def _read_shm(handle: pb.ShmHandle, nbytes: int, where: str) -> bytearray:
    name = handle.name
    if not _SHM_NAME.match(name) or name in (".", ".."):
        raise InvalidRequestError(f"{where}.shm.name {name!r} is not a plain shared-memory segment name")
    if handle.nbytes != nbytes:
        raise InvalidRequestError(f"{where}.shm.nbytes is {handle.nbytes}; the shape and dtype need {nbytes}")
    try:
        with open(SHM_DIR / name, "rb") as segment:
            size = os.fstat(segment.fileno()).st_size
            if handle.offset + nbytes > size:
                raise InvalidRequestError(
                    f"{where}.shm range [{handle.offset}, {handle.offset + nbytes}) exceeds the {size}-byte segment"
                )
            segment.seek(handle.offset)
            buffer = bytearray(nbytes)
            if segment.readinto(buffer) != nbytes:
                raise InvalidRequestError(f"{where}.shm segment {name!r} ended early")
            return buffer
    except FileNotFoundError:
        raise InvalidRequestError(f"{where}.shm segment {name!r} does not exist on the engine's host") from None


def pixel_digest(pixel_values: torch.Tensor) -> str:
    """The engine's own key for an item's pixels (its encoder cache, prefix-cache block hashes).

    The caller's ``content_hash`` hashes the media file, which the engine never sees, so it cannot be checked: a
    client that sent other pixels under a known hash would otherwise be served, and would poison, the cached
    embeddings and KV blocks of that media for every other request.  Hashing what arrived costs ~1.5 ms per MB
    (blake2b, outside the GIL)."""
    digest = hashlib.blake2b(pixel_values.contiguous().view(torch.uint8).numpy(), digest_size=20)  # any dtype: bytes
    digest.update(f"\0{pixel_values.dtype}\0{tuple(pixel_values.shape)}".encode())
    return digest.hexdigest()


def mm_items_from_proto(items, max_tensor_bytes: int) -> list[MultimodalSpec]:
    specs = []
    for index, item in enumerate(items):
        where = f"mm_items[{index}]"
        modality = _MODALITIES.get(item.modality)
        pixel_values = tensor_from_proto(item.pixel_values, f"{where}.pixel_values", max_tensor_bytes)
        if modality is None:
            raise InvalidRequestError(f"{where}.modality is unspecified")
        if not item.content_hash:
            raise InvalidRequestError(f"{where}.content_hash is empty")
        specs.append(
            MultimodalSpec(
                modality=modality,
                content_hash=pixel_digest(pixel_values),
                pixel_values=pixel_values,
                grids=tuple((int(g.t), int(g.h), int(g.w)) for g in item.grids),
                placeholders=tuple((int(p.offset), int(p.length)) for p in item.placeholders),
            )
        )
    return specs


def responses_from_outputs(request_id: str, outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
    """One chunk with every new token of ``outputs``, then the completion if the request ended."""
    responses = []
    tokens = [t for o in outputs for t in o.new_token_ids]
    last = outputs[-1]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    if tokens or prompt_logprobs is not None:
        chunk = pb.GenerateChunk(
            token_ids=tokens,
            logprobs=[lp for o in outputs for lp in o.new_logprobs],
            top_logprobs=[
                pb.TopLogprobs(token_ids=ids, logprobs=values) for o in outputs for ids, values in o.new_top_logprobs
            ],
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=last.num_output_tokens,
            cached_tokens=last.num_cached_tokens,
        )
        if prompt_logprobs is not None:
            chunk.prompt_logprobs.logprobs.extend(prompt_logprobs.logprobs)
            chunk.prompt_logprobs.top_logprobs.extend(
                pb.TopLogprobs(token_ids=ids, logprobs=values) for ids, values in prompt_logprobs.top
            )
        responses.append(pb.GenerateResponse(request_id=request_id, chunk=chunk))
    if last.finish_reason is not None:
        complete = pb.GenerateComplete(
            finish_reason=_FINISH_REASONS[last.finish_reason],
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=last.num_output_tokens,
            cached_tokens=last.num_cached_tokens,
            abort_message=last.abort_message,
        )
        if last.finish_reason is FinishReason.STOP and last.stop_token_id is not None:
            complete.matched_stop_token_id = last.stop_token_id
        responses.append(pb.GenerateResponse(request_id=request_id, complete=complete))
    return responses
