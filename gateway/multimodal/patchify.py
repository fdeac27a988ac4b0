"""Frames -> flattened patches in the reference's order, and the optional normalization.

Layout of one item (what the engine receives): a C-contiguous ``[num_patches, C * tp * P * P]`` array.
Rows run over ``(t, h_block, w_block, h_in_block, w_in_block)`` with blocks of ``merge x merge``
patches; columns over ``(channel, temporal, y, x)``.  ``P`` is the patch size, ``tp`` the temporal
patch size; frames are padded to a multiple of ``tp`` by repeating the last one (a still image is
its own frame repeated ``tp`` times).  This is exactly ``pixel_values`` / ``pixel_values_videos`` of
``MiniMaxM3VLImageProcessor`` / ``MiniMaxM3VLVideoProcessor`` (and of Qwen2-VL) before rescaling.

Normalized values are ``(pixel - mean[c] * 255) / (std[c] * 255)`` in float32, the reference's fused
rescale-and-normalize; a 256-entry table per channel gives the same float32 results.
"""

from collections.abc import Sequence

import numpy as np


def patchify_into(frames: np.ndarray, out: np.ndarray, patch: int, merge: int, temporal: int) -> None:
    """Write ``frames`` ``[T, H, W, C]`` uint8 into ``out`` ``[grid_t * gh * gw, C * temporal * patch * patch]``."""
    count, height, width, channels = frames.shape
    grid_t, grid_h, grid_w = -(-count // temporal), height // patch, width // patch
    if grid_h % merge or grid_w % merge or height % patch or width % patch:
        raise ValueError(f"{height}x{width} frames do not split into {merge}x{merge} blocks of {patch}px patches")
    expected = (grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    if out.shape != expected or out.dtype != frames.dtype:
        raise ValueError(f"output is {out.shape} {out.dtype}, expected {expected} {frames.dtype}")
    target = out.reshape(grid_t, grid_h // merge, grid_w // merge, merge, merge, channels, temporal, patch, patch)
    blocks = (grid_h // merge, merge, patch, grid_w // merge, merge, patch, channels)
    # (group, temporal, hb, mh, py, wb, mw, px, c) -> (group, hb, wb, mh, mw, c, temporal, py, px)
    order = (0, 2, 5, 3, 6, 8, 1, 4, 7)
    full = count // temporal
    if full:
        target[:full] = frames[: full * temporal].reshape(full, temporal, *blocks).transpose(order)
    if full < grid_t:
        # The last group lacks frames: repeat the last one (an image is one frame in every slot).
        rest = frames[full * temporal :]  # 1 .. temporal - 1 frames
        tail = target[full:]
        tail[:, :, :, :, :, :, : len(rest)] = rest.reshape(1, len(rest), *blocks).transpose(order)
        for step in range(len(rest), temporal):  # copying within the output beats gathering again
            tail[:, :, :, :, :, :, step] = tail[:, :, :, :, :, :, len(rest) - 1]


def normalization_table(mean: Sequence[float], std: Sequence[float], rescale_factor: float) -> np.ndarray:
    """``[C, 256]`` float32: the normalized value of each uint8 level per channel, computed as the
    reference does (mean and std scaled by ``1 / rescale_factor`` in float32, then subtract and divide)."""
    scale = 1.0 / rescale_factor
    scaled_mean = (np.asarray(mean, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    scaled_std = (np.asarray(std, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    levels = np.arange(256, dtype=np.float32)
    return ((levels[None, :] - scaled_mean[:, None]) / scaled_std[:, None]).astype(np.float32)


def normalize_patches(patches: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 patches ``[N, C * k]`` -> float32 normalized patches of the same shape."""
    channels = table.shape[0]
    per_channel = patches.reshape(patches.shape[0], channels, -1)
    out = np.empty(per_channel.shape, dtype=np.float32)
    for channel in range(channels):
        np.take(table[channel], per_channel[:, channel], out=out[:, channel])
    return out.reshape(patches.shape)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as the uint16 bit patterns (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)
