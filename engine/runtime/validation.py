"""Turn a caller's inputs into a ``Request`` the engine can run, or an ``InvalidRequestError`` saying what is wrong.

Everything that could make a forward pass fail or read out of bounds is checked here, before the
request reaches the scheduler: token ids, the context limit, sampling values, and for images and
videos the grid, the patch tensor's shape, and that the placeholder ranges hold exactly as many
image/video tokens as the item produces embeddings.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3stack.engine.runtime.config import ModelInfo
from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.request import Modality, MultimodalInput, Request, SamplingParams

MAX_REQUEST_ID_LENGTH = 256


@dataclass
class MultimodalSpec:
    """An image or video as the caller describes it, before its embedding positions are known."""

    modality: Modality
    content_hash: str
    pixel_values: torch.Tensor
    grid_thw: tuple[int, ...]
    placeholders: tuple[tuple[int, int], ...]


def build_request(
    info: ModelInfo,
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    mm_items: Sequence[MultimodalSpec] = (),
    cache_salt: str = "",
    priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequestError(f"request_id must have 1..{MAX_REQUEST_ID_LENGTH} characters")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("input_ids is empty")
    bad = [t for t in prompt if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(f"input_ids {bad[:8]} are outside the vocabulary [0, {info.vocab_size})")
    if len(prompt) >= info.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; the context limit is {info.max_model_len} "
            "including at least one generated token"
        )
    sampling.validate(info.vocab_size)
    room = info.max_model_len - len(prompt)
    max_tokens = room if sampling.max_new_tokens is None else min(sampling.max_new_tokens, room)
    mm_inputs = _multimodal_inputs(info, prompt, mm_items)
    return Request(
        request_id,
        prompt,
        sampling,
        max_tokens=max_tokens,
        eos_token_ids=frozenset(info.eos_token_ids),
        mm_inputs=mm_inputs,
        cache_salt=cache_salt,
        priority=priority,
        arrival_time=arrival_time,
    )


def _multimodal_inputs(info: ModelInfo, prompt: list[int], items: Sequence[MultimodalSpec]) -> list[MultimodalInput]:
    placeholder_ids = {Modality.IMAGE: info.image_token_id, Modality.VIDEO: info.video_token_id}
    if items and not info.supports_vision:
        raise InvalidRequestError("this model has no vision tower; mm_items must be empty")
    inputs = [
        _multimodal_input(info, prompt, index, item, placeholder_ids[item.modality]) for index, item in enumerate(items)
    ]
    inputs.sort(key=lambda item: item.span[0])
    for before, after in itertools.pairwise(inputs):
        if after.span[0] < before.span[1]:
            raise InvalidRequestError("mm_items have overlapping placeholder ranges")
    covered = torch.zeros(len(prompt), dtype=torch.bool)
    for item in inputs:
        covered[item.embed_positions] = True
    tokens = torch.tensor(prompt)
    stray = ((tokens == info.image_token_id) | (tokens == info.video_token_id)) & ~covered
    if bool(stray.any()):
        position = int(stray.nonzero()[0])
        raise InvalidRequestError(
            f"input_ids[{position}] is an image/video placeholder token outside every mm_items placeholder range"
        )
    return inputs


def _multimodal_input(
    info: ModelInfo, prompt: list[int], index: int, item: MultimodalSpec, placeholder_id: int
) -> MultimodalInput:
    where = f"mm_items[{index}]"
    if len(item.grid_thw) != 3 or any(v <= 0 for v in item.grid_thw):
        raise InvalidRequestError(f"{where}.grid_thw must be 3 positive integers (t, h, w), got {list(item.grid_thw)}")
    t, h, w = (int(v) for v in item.grid_thw)
    merge = info.spatial_merge_size
    if h % merge or w % merge:
        raise InvalidRequestError(f"{where}.grid_thw h={h}, w={w} must be multiples of the merge size {merge}")
    num_patches = t * h * w
    expected_shape = (num_patches, info.patch_dim)
    if tuple(item.pixel_values.shape) != expected_shape:
        raise InvalidRequestError(
            f"{where}.pixel_values has shape {list(item.pixel_values.shape)}; grid_thw {[t, h, w]} needs "
            f"{list(expected_shape)}"
        )
    if item.pixel_values.is_floating_point() and not bool(torch.isfinite(item.pixel_values).all()):
        raise InvalidRequestError(f"{where}.pixel_values holds NaN or infinite values")
    if not item.placeholders:
        raise InvalidRequestError(f"{where}.placeholders is empty")
    previous_end = 0
    positions = []
    for offset, length in item.placeholders:
        if length <= 0 or offset < previous_end or offset + length > len(prompt):
            raise InvalidRequestError(
                f"{where}.placeholders must be sorted, disjoint, non-empty ranges inside the {len(prompt)}-token "
                f"prompt; got {[list(p) for p in item.placeholders]}"
            )
        positions += [p for p in range(offset, offset + length) if prompt[p] == placeholder_id]
        previous_end = offset + length
    num_embeds = num_patches // (merge * merge)
    if len(positions) != num_embeds:
        raise InvalidRequestError(
            f"{where} produces {num_embeds} embeddings (grid {[t, h, w]}, merge {merge}) but its placeholder "
            f"ranges hold {len(positions)} {item.modality.value} tokens (id {placeholder_id})"
        )
    if not item.content_hash:
        raise InvalidRequestError(f"{where}.content_hash is empty")
    return MultimodalInput(
        modality=item.modality,
        # The grid and modality join the caller's hash so a reused hash can never alias different shapes.
        content_hash=f"{item.content_hash}|{item.modality.value}|{t}x{h}x{w}",
        pixel_values=item.pixel_values,
        grid_thw=(t, h, w),
        placeholders=tuple((int(o), int(n)) for o, n in item.placeholders),
        embed_positions=torch.tensor(positions, dtype=torch.int64),
    )
