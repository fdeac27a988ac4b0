"""Requests and multimodal items for the engine's tests (plain runtime objects, no model needed)."""

import itertools

import pytest
import torch

from m3stack.engine.runtime.request import Modality, MultimodalInput, Request, SamplingParams

_ids = itertools.count()


def make_request(
    prompt: list[int],
    *,
    max_tokens: int = 8,
    request_id: str | None = None,
    sampling: SamplingParams | None = None,
    eos: frozenset[int] = frozenset(),
    mm_inputs: list[MultimodalInput] | None = None,
    salt: str = "",
    priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        sampling or SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        eos_token_ids=eos,
        mm_inputs=mm_inputs or [],
        cache_salt=salt,
        priority=priority,
        arrival_time=arrival_time,
    )


def make_image(content_hash: str, positions: range, patch_dim: int = 4) -> MultimodalInput:
    """An item whose embeddings fill the contiguous prompt span ``positions``."""
    count = len(positions)
    return MultimodalInput(
        modality=Modality.IMAGE,
        content_hash=content_hash,
        pixel_values=torch.zeros((count * 4, patch_dim)),
        grids=((1, 2, 2 * count),),
        placeholders=((positions.start, count),),
        embed_positions=torch.arange(positions.start, positions.stop),
    )


@pytest.fixture
def new_request():
    return make_request


@pytest.fixture
def new_image():
    return make_image
