"""Frames -> flattened patches in the reference's order, and the optional normalization.

Layout of one item (what the engine receives): a C-contiguous ``[num_patches, C * tp * P * P]`` array.
Rows run over ``(t, h_block, w_block, h_in_block, w_in_block)`` with blocks of ``merge x merge``
patches; columns over ``(channel, temporal, y, x)``.  ``P`` is the patch size, ``tp`` the temporal
patch size; frames are padded to a multiple of ``tp`` by repeating the last one (a still image is
its own frame repeated ``tp`` times).  This is exactly ``pixel_values`` / ``pixel_values_videos`` of
``MiniMaxM3VLImageProcessor`` / ``MiniMaxM3VLVideoProcessor`` (and of Qwen2-VL) before rescaling.

Normalized values are ``(pixel - mean[c] * 255) / (std[c] * 255)`` in float32, the reference's fused
rescale-and-normalize; a 256-entry table per channel gives the same float32 results, and a table of their
bfloat16 roundings gives the bfloat16 output in one lookup (no float32 intermediate).
"""

from collections.abc import Sequence

import numpy as np


def patchify_into(frames: np.ndarray, out: np.ndarray, patch: int, merge: int, temporal: int) -> None:
    """Write ``frames`` ``[T, H, W, C]`` uint8 into ``out`` ``[grid_t * gh * gw, C * temporal * patch * patch]``.

    Two passes, each with long inner loops (one 9-axis transpose has 14-byte ones and costs ~20% more):
    first every patch row (``patch`` pixels x ``C`` channels, contiguous in a frame) moves as one opaque
    element into patch order, then each patch's pixels are split into channel planes.
    """
    count, height, width, channels = frames.shape
    grid_t, grid_h, grid_w = -(-count // temporal), height // patch, width // patch
    if grid_h % merge or grid_w % merge or height % patch or width % patch:
        raise ValueError(f"{height}x{width} frames do not split into {merge}x{merge} blocks of {patch}px patches")
    expected = (grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    if out.shape != expected or out.dtype != frames.dtype or frames.dtype != np.uint8:
        raise ValueError(f"output is {out.shape} {out.dtype}, expected {expected} uint8")
    row = np.dtype((np.void, patch * channels))
    # (frame, hb, mh, py, wb, mw) of patch rows
    rows = np.ascontiguousarray(frames).reshape(count, height, width * channels).view(row)
    rows = rows.reshape(count, grid_h // merge, merge, patch, grid_w // merge, merge)
    # (group, hb, wb, mh, mw, temporal, py): rows in the output's patch order
    ordered = np.empty((grid_t, grid_h // merge, grid_w // merge, merge, merge, temporal, patch), dtype=row)
    full, rest = divmod(count, temporal)
    if full:
        grouped = rows[: full * temporal].reshape(full, temporal, *rows.shape[1:])
        ordered[:full] = grouped.transpose(0, 2, 5, 3, 6, 1, 4)
    if rest:  # the last group lacks frames (an image is one frame in every slot)
        ordered[full, ..., :rest, :] = rows[full * temporal :].transpose(1, 4, 2, 5, 0, 3)
    pixels = ordered.view(np.uint8).reshape(grid_t * grid_h * grid_w, temporal, patch * patch, channels)
    target = out.reshape(pixels.shape[0], channels, temporal, patch * patch)
    complete = full * grid_h * grid_w
    target[:complete] = pixels[:complete].transpose(0, 3, 1, 2)
    if rest:
        target[complete:, :, :rest] = pixels[complete:, :rest].transpose(0, 3, 1, 2)
        for step in range(rest, temporal):  # repeat the last frame: copying within the output beats splitting again
            target[complete:, :, step] = target[complete:, :, rest - 1]


def normalization_table(mean: Sequence[float], std: Sequence[float], rescale_factor: float) -> np.ndarray:
    """``[C, 256]`` float32: the normalized value of each uint8 level per channel, computed as the
    reference does (mean and std scaled by ``1 / rescale_factor`` in float32, then subtract and divide)."""
    scale = 1.0 / rescale_factor
    scaled_mean = (np.asarray(mean, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    scaled_std = (np.asarray(std, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    levels = np.arange(256, dtype=np.float32)
    return ((levels[None, :] - scaled_mean[:, None]) / scaled_std[:, None]).astype(np.float32)


def normalize_patches(patches: np.ndarray, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 patches ``[N, C * k]`` -> each level looked up in its channel's ``table`` row (``[C, 256]``, float32
    values or their bfloat16 bit patterns), written to ``out`` (same shape, the table's dtype) or a new array."""
    channels = table.shape[0]
    per_channel = patches.reshape(patches.shape[0], channels, -1)
    if out is None:
        out = np.empty(patches.shape, dtype=table.dtype)
    if out.shape != patches.shape or out.dtype != table.dtype or not out.flags.c_contiguous:
        raise ValueError(f"output is {out.shape} {out.dtype}, expected a C-contiguous {patches.shape} {table.dtype}")
    target = out.reshape(per_channel.shape)
    for channel in range(channels):
        np.take(table[channel], per_channel[:, channel], out=target[:, channel])
    return out


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as the uint16 bit patterns (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)
