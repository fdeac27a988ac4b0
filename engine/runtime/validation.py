"""Turn a caller's inputs into a ``Request`` the engine can run, or an ``InvalidRequestError`` saying what is wrong.

Everything that could make a forward pass fail or read out of bounds is checked here, before the
request reaches the scheduler: token ids, the context limit, sampling values, and for images and
videos the grid, the patch tensor's shape, and that the placeholder ranges hold exactly as many
image/video tokens as the item produces embeddings.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.model_info import ModelInfo
from m3stack.engine.runtime.request import Modality, MultimodalInput, Request, SamplingParams

MAX_REQUEST_ID_LENGTH = 256


@dataclass
class MultimodalSpec:
    """An image or video as the caller describes it, before its embedding positions are known."""

    modality: Modality
    content_hash: str
    pixel_values: torch.Tensor
    grids: tuple[tuple[int, ...], ...]  # (t, h, w) per vision segment, as sent
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
    tokens = _token_array(prompt_token_ids, info.vocab_size)
    if tokens.size >= info.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {tokens.size} tokens; the context limit is {info.max_model_len} "
            "including at least one generated token"
        )
    sampling.validate(info.vocab_size)
    room = info.max_model_len - tokens.size
    max_tokens = room if sampling.max_new_tokens is None else min(sampling.max_new_tokens, room)
    mm_inputs = _multimodal_inputs(info, tokens, mm_items)
    prompt = tokens.tolist()
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


def _token_array(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The prompt as a non-empty int64 array of ids in ``[0, vocab_size)``, checked in numpy: a 60K-token prompt's
    Python-level checks took ~20 ms of the event loop's thread (which the engine thread shares the GIL with), so
    64 such prompts arriving together delayed every first token by over a second.  A protobuf repeated field
    converts without a per-element loop."""
    try:
        tokens = np.asarray(token_ids)
    except ValueError as exc:  # ragged nesting
        raise InvalidRequestError(f"input_ids must be a flat list of integers: {exc}") from exc
    if tokens.ndim != 1:
        raise InvalidRequestError("input_ids must be a flat list of integers")
    if tokens.size == 0:
        raise InvalidRequestError("input_ids is empty")
    if tokens.dtype == object and all(type(t) is int for t in tokens):  # Python ints beyond 64 bits
        bad = [t for t in tokens.tolist() if not 0 <= t < vocab_size][:8]
        raise InvalidRequestError(f"input_ids {bad} are outside the vocabulary [0, {vocab_size})")
    if tokens.dtype.kind not in "iu":
        raise InvalidRequestError("input_ids must be a flat list of integers")
    out_of_vocabulary = (tokens < 0) | (tokens >= vocab_size)  # before the int64 cast: no uint64 wrap-around
    if out_of_vocabulary.any():
        bad = tokens[out_of_vocabulary][:8].tolist()
        raise InvalidRequestError(f"input_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return tokens.astype(np.int64, copy=False)


def _multimodal_inputs(info: ModelInfo, tokens: np.ndarray, items: Sequence[MultimodalSpec]) -> list[MultimodalInput]:
    placeholder_ids = {Modality.IMAGE: info.image_token_id, Modality.VIDEO: info.video_token_id}
    if items and not info.supports_vision:
        raise InvalidRequestError("this model has no vision tower; mm_items must be empty")
    inputs = [
        _multimodal_input(info, tokens, index, item, placeholder_ids[item.modality]) for index, item in enumerate(items)
    ]
    inputs.sort(key=lambda item: item.span[0])
    for before, after in itertools.pairwise(inputs):
        if after.span[0] < before.span[1]:
            raise InvalidRequestError("mm_items have overlapping placeholder ranges")
    stray = (tokens == info.image_token_id) | (tokens == info.video_token_id)
    for item in inputs:
        stray[item.embed_positions.numpy()] = False
    if stray.any():
        position = int(np.flatnonzero(stray)[0])
        raise InvalidRequestError(
            f"input_ids[{position}] is an image/video placeholder token outside every mm_items placeholder range"
        )
    return inputs


def _multimodal_input(
    info: ModelInfo, tokens: np.ndarray, index: int, item: MultimodalSpec, placeholder_id: int
) -> MultimodalInput:
    where = f"mm_items[{index}]"
    grids = _checked_grids(where, item, info.spatial_merge_size)
    merge_unit = info.spatial_merge_size**2
    num_patches = sum(t * h * w for t, h, w in grids)
    expected_shape = (num_patches, info.patch_dim)
    if tuple(item.pixel_values.shape) != expected_shape:
        raise InvalidRequestError(
            f"{where}.pixel_values has shape {list(item.pixel_values.shape)}; grids {_grid_text(grids)} need "
            f"{list(expected_shape)}"
        )
    if item.pixel_values.is_floating_point() and not bool(torch.isfinite(item.pixel_values).all()):
        raise InvalidRequestError(f"{where}.pixel_values holds NaN or infinite values")
    if not item.placeholders:
        raise InvalidRequestError(f"{where}.placeholders is empty")
    previous_end = 0
    positions = []
    for offset, length in item.placeholders:
        if length <= 0 or offset < previous_end or offset + length > tokens.size:
            raise InvalidRequestError(
                f"{where}.placeholders must be sorted, disjoint, non-empty ranges inside the {tokens.size}-token "
                f"prompt; got {[list(p) for p in item.placeholders]}"
            )
        positions.append(offset + np.flatnonzero(tokens[offset : offset + length] == placeholder_id))
        previous_end = offset + length
    embed_positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    num_embeds = num_patches // merge_unit
    if embed_positions.size != num_embeds:
        raise InvalidRequestError(
            f"{where} produces {num_embeds} embeddings (grids {_grid_text(grids)}, merge {info.spatial_merge_size}) "
            f"but its placeholder ranges hold {embed_positions.size} {item.modality.value} tokens (id {placeholder_id})"
        )
    _check_segments_fill_ranges(where, grids, [p.size for p in positions], merge_unit)
    if not item.content_hash:
        raise InvalidRequestError(f"{where}.content_hash is empty")
    return MultimodalInput(
        modality=item.modality,
        # The grids and modality join the caller's hash so a reused hash can never alias different shapes.
        content_hash=f"{item.content_hash}|{item.modality.value}|{_grid_text(grids)}",
        pixel_values=item.pixel_values,
        grids=grids,
        placeholders=tuple((int(o), int(n)) for o, n in item.placeholders),
        embed_positions=torch.from_numpy(embed_positions.astype(np.int64, copy=False)),
    )


def _checked_grids(where: str, item: MultimodalSpec, merge: int) -> tuple[tuple[int, int, int], ...]:
    """The item's vision segments: at least one (t, h, w) of positive sizes with h, w multiples of the merge size;
    an image is one frame (one grid, t = 1), a video's segments are cut from one frame size."""
    if not item.grids:
        raise InvalidRequestError(f"{where}.grids is empty: every item needs one (t, h, w) per vision segment")
    grids = []
    for number, grid in enumerate(item.grids):
        if len(grid) != 3 or any(v <= 0 for v in grid):
            raise InvalidRequestError(
                f"{where}.grids[{number}] must be 3 positive integers (t, h, w), got {list(grid)}"
            )
        t, h, w = (int(v) for v in grid)
        if h % merge or w % merge:
            raise InvalidRequestError(
                f"{where}.grids[{number}] h={h}, w={w} must be multiples of the merge size {merge}"
            )
        grids.append((t, h, w))
    if item.modality is Modality.IMAGE and (len(grids) != 1 or grids[0][0] != 1):
        raise InvalidRequestError(f"{where} is an image: one grid with t = 1, got {_grid_text(grids)}")
    if len({(h, w) for _, h, w in grids}) > 1:
        raise InvalidRequestError(f"{where}.grids differ in h or w: {_grid_text(grids)} (one video has one frame size)")
    return tuple(grids)


def _check_segments_fill_ranges(
    where: str, grids: Sequence[tuple[int, int, int]], range_tokens: Sequence[int], merge_unit: int
) -> None:
    """Each segment's embeddings end where a placeholder range ends: a range never holds the end of one vision
    segment and the start of the next, so the grids and the prompt agree on where segments (and frames) start."""
    range_ends = set(itertools.accumulate(range_tokens))
    segment_end = 0
    for number, (t, h, w) in enumerate(grids[:-1]):
        segment_end += t * h * w // merge_unit
        if segment_end not in range_ends:
            raise InvalidRequestError(
                f"{where}.grids[{number}] ends after {segment_end} embeddings, inside a placeholder range "
                f"(ranges hold {list(range_tokens)} tokens): a segment's embeddings must fill whole ranges"
            )


def _grid_text(grids: Sequence[tuple[int, int, int]]) -> str:
    return ",".join(f"{t}x{h}x{w}" for t, h, w in grids)
