"""Builders shared by the runtime tests (plain requests and multimodal items, no model needed)."""

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
        grid_thw=(1, 2, 2 * count),
        placeholders=((positions.start, count),),
        embed_positions=torch.arange(positions.start, positions.stop),
    )


@pytest.fixture
def new_request():
    return make_request


@pytest.fixture
def new_image():
    return make_image


@pytest.fixture
def build_core(tiny_model_dir):
    """An ``EngineCore`` on the tiny model, its KV cache poisoned with NaN so reading an unwritten slot shows."""
    from m3stack.engine.runtime.builder import build_engine_core
    from m3stack.engine.runtime.config import EngineConfig

    def build(**overrides):
        settings = {"model": str(tiny_model_dir), "num_kv_blocks": 256, "max_num_batched_tokens": 256, **overrides}
        core = build_engine_core(EngineConfig(**settings))
        for layer in core.runner.backend.kv_caches:
            for tensor in (layer.key, layer.value, layer.index_key):
                if tensor is not None:
                    tensor.fill_(float("nan"))
        return core

    return build
