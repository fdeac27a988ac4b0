"""Qwen2-VL (``model_type: qwen2_vl``): the second profile, proof that a model is constants plus what differs.

Matches ``transformers.models.qwen2_vl`` (5.24) ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor``
(``cap_pixels_per_frame=False``, frames sampled at ``fps``) and ``Qwen2VLProcessor``'s expansion of
``<|image_pad|>`` / ``<|video_pad|>``.
"""

import math
from pathlib import Path

import numpy as np

from .model_profile import ModelProfile, PromptSpec
from .patch_grid import CLIP_MEAN, CLIP_STD, PatchGridConstants, PatchGridPreprocessor
from .plans import ImagePlan, VideoPlan, VideoProbe
from .resize import ResizeBackend

MODEL_TYPE = "qwen2_vl"

DEFAULTS = PatchGridConstants(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_min_pixels=56 * 56,
    image_max_pixels=28 * 28 * 1280,
    video_min_pixels=128 * 28 * 28,
    video_max_pixels=28 * 28 * 768,
    image_mean=CLIP_MEAN,
    image_std=CLIP_STD,
    rescale_factor=1 / 255,
    fps=2.0,
    min_frames=4,
    max_frames=768,
    vision_segment_max_frames=None,
)


def sample_frames(probe: VideoProbe, constants: PatchGridConstants) -> list[int]:
    """An even count between ``min_frames`` and ``max_frames`` at ``fps``, then ``arange(0, total, total / n)``
    truncated, computed the way torch does (double steps rounded to float32)."""
    total, temporal = probe.frame_count, constants.temporal_patch_size
    ceiling = math.floor(min(constants.max_frames, total) / temporal) * temporal
    wanted = total / probe.fps * constants.fps if probe.fps > 0 else total
    count = math.floor(min(max(wanted, constants.min_frames), ceiling, total) / temporal) * temporal
    if count <= 0:
        return list(range(total))
    step = total / count
    positions = (np.arange(math.ceil(total / step), dtype=np.float64) * step).astype(np.float32)
    return positions.astype(np.int64).tolist()


class Qwen2VLPromptSpec(PromptSpec):
    image_marker = image_token = "<|image_pad|>"
    video_marker = video_token = "<|video_pad|>"

    def image_text(self, plan: ImagePlan, tokens: int) -> str:
        return self.image_token * tokens

    def video_text(self, plan: VideoPlan, tokens: int) -> str:
        return self.video_token * tokens


def profile(checkpoint: Path | None = None, resize_backend: ResizeBackend = ResizeBackend.AUTO) -> ModelProfile:
    return ModelProfile(MODEL_TYPE, PatchGridPreprocessor(DEFAULTS, sample_frames, resize_backend), Qwen2VLPromptSpec())
