"""``patchify_into`` against the layout written out patch by patch (patchify.py's docstring), for the
frame counts, temporal and merge sizes and input layouts the two passes must all get right."""

import itertools

import numpy as np
import pytest
import torch

from m3stack.gateway.multimodal import m3
from m3stack.gateway.multimodal.patchify import patchify_into


def _patches_one_by_one(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    count, height, width, _ = frames.shape
    grid_t, grid_h, grid_w = -(-count // temporal), height // patch, width // patch
    rows = []
    for group in range(grid_t):
        slots = [frames[min(group * temporal + step, count - 1)] for step in range(temporal)]
        for hb, wb in itertools.product(range(grid_h // merge), range(grid_w // merge)):
            for mh, mw in itertools.product(range(merge), range(merge)):
                y, x = (hb * merge + mh) * patch, (wb * merge + mw) * patch
                patches = [slot[y : y + patch, x : x + patch] for slot in slots]  # temporal x [py, px, c]
                rows.append(np.stack(patches).transpose(3, 0, 1, 2).reshape(-1))  # (c, t, py, px)
    return np.stack(rows)


@pytest.mark.parametrize(
    "count, temporal, merge, patch, grid",
    [(1, 2, 2, 14, (4, 6)), (2, 2, 2, 14, (2, 4)), (5, 2, 2, 4, (4, 2)), (3, 1, 1, 3, (3, 5)), (5, 3, 2, 2, (2, 2))],
)
def test_patchify_matches_the_layout(count, temporal, merge, patch, grid):
    rng = np.random.default_rng(count * 100 + temporal * 10 + merge)
    frames = rng.integers(0, 256, (count, grid[0] * patch, grid[1] * patch, 3), dtype=np.uint8)
    expected = _patches_one_by_one(frames, patch, merge, temporal)
    planar = np.ascontiguousarray(frames.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1)  # strided input
    for source in (frames, planar):
        out = np.full(expected.shape, 3, dtype=np.uint8)
        patchify_into(source, out, patch, merge, temporal)
        np.testing.assert_array_equal(out, expected)


def test_patchify_refuses_mismatched_shapes():
    frames = np.zeros((1, 28, 28, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="do not split"):
        patchify_into(frames[:, :27], np.zeros((4, 1176), dtype=np.uint8), 14, 2, 2)
    with pytest.raises(ValueError, match="expected"):
        patchify_into(frames, np.zeros((4, 1175), dtype=np.uint8), 14, 2, 2)


def test_bfloat16_lookup_equals_torch_rounding_of_the_float32_normalization():
    """Every level of every channel: the bf16 table gives torch's bfloat16 cast of the float32 values."""
    preprocessor = m3.profile().preprocessor
    levels = np.tile(np.arange(256, dtype=np.uint8), 3 * 2 * 196 // 256 + 1)[: 3 * 2 * 196]
    patches = np.stack([levels, np.roll(levels, 7), levels[::-1]])  # each level in each channel's columns
    expected = torch.from_numpy(preprocessor.normalize(patches)).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(preprocessor.normalize_bfloat16(patches), expected.view(np.uint16))
    out = np.zeros(patches.shape, dtype=np.uint16)
    assert preprocessor.normalize_bfloat16(patches, out=out) is out
    np.testing.assert_array_equal(out, expected.view(np.uint16))
    with pytest.raises(ValueError, match="expected"):
        preprocessor.normalize_bfloat16(patches, out=np.zeros(patches.shape, dtype=np.float32))
