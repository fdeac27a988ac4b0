"""The torch resize backend writes channels-last output straight from the uint8 kernel: it must equal
``interpolate`` (what the reference runs) for every input layout a decoder hands over."""

import numpy as np
import pytest
import torch
from torch.nn.functional import interpolate

from m3stack.gateway.multimodal.resize import ResizeBackend, resize_frames, resize_into


def _interpolate(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    source = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None]
    resized = interpolate(source, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized[0].permute(1, 2, 0).numpy()


def _views(rng: np.random.Generator, height: int, width: int) -> dict[str, np.ndarray]:
    padded = rng.integers(0, 256, (height, width + 7, 3), dtype=np.uint8)
    square = rng.integers(0, 256, (width, height, 3), dtype=np.uint8)
    return {
        "contiguous": rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
        "padded-rows": padded[:, :width],  # a decoder's line padding
        "rotated": np.rot90(square, 1),  # negative strides
        "flipped": padded[::-1, :width],
    }


@pytest.mark.parametrize(
    "source, target",
    [((97, 131), (56, 84)), ((40, 30), (112, 84)), ((60, 250), (60, 112)), ((333, 90), (140, 90)), ((5, 5), (28, 28))],
)
def test_torch_resize_equals_interpolate(source, target):
    rng = np.random.default_rng(sum(source) * 31 + sum(target))
    for name, frame in _views(rng, *source).items():
        out = np.full((*target, 3), 7, dtype=np.uint8)
        resize_into(frame, out, ResizeBackend.TORCH)
        np.testing.assert_array_equal(out, _interpolate(frame, *target), err_msg=name)


def test_batch_resize_is_per_frame_and_same_size_passes_through():
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (3, 50, 70, 3), dtype=np.uint8)
    resized = resize_frames(frames, 28, 56, ResizeBackend.TORCH)
    assert resized.flags.c_contiguous
    for frame, out in zip(frames, resized, strict=True):
        np.testing.assert_array_equal(out, _interpolate(frame, 28, 56))
    assert resize_frames(frames, 50, 70, ResizeBackend.TORCH) is frames


def test_resize_output_must_be_contiguous_rgb():
    frame = np.zeros((20, 20, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        resize_into(frame, np.zeros((28, 56, 3), dtype=np.uint8)[:, ::2], ResizeBackend.TORCH)
    with pytest.raises(ValueError, match="C-contiguous"):
        resize_into(frame, np.zeros((28, 28, 4), dtype=np.uint8), ResizeBackend.PILLOW)
