"""MiniMax-M3 (``model_type: minimax_m3_vl``): constants, frame sampling and prompt layout.

Matches ``transformers.models.minimax_m3_vl`` (5.24): ``MiniMaxM3VLImageProcessor``,
``MiniMaxM3VLVideoProcessor`` and ``MiniMaxM3VLProcessor``.  What the gateway decides on its own:

* videos are always sampled at ``fps`` (the video processor's ``do_sample_frames`` defaults to off
  and the processor's ``do_resize`` to off, which only work for pre-sampled, pre-sized frames);
* a video with fewer frames than ``fps`` asks for keeps every frame (the reference raises);
* ``min_frames``, ``max_frames`` and ``total_pixels`` are declared by the reference but not applied
  by it; the gateway applies none of them to the output either, and enforces its own limits
  (``limits.py``) instead, so outputs stay equal to the reference's.
"""

import json
import logging
from pathlib import Path
from typing import Any

from .model_profile import ModelProfile, PromptSpec
from .patch_grid import CLIP_MEAN, CLIP_STD, PatchGridConstants, PatchGridPreprocessor
from .plans import ImagePlan, VideoPlan, VideoProbe
from .resize import ResizeBackend

logger = logging.getLogger(__name__)

MODEL_TYPE = "minimax_m3_vl"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the only resample the kernels implement

DEFAULTS = PatchGridConstants(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_min_pixels=4 * 28 * 28,
    image_max_pixels=451584,
    video_min_pixels=4 * 28 * 28,
    video_max_pixels=768 * 28 * 28,
    image_mean=CLIP_MEAN,
    image_std=CLIP_STD,
    rescale_factor=1 / 255,
    fps=1.0,
    min_frames=4,
    max_frames=768,
    vision_segment_max_frames=4,
)


def sample_frames(probe: VideoProbe, constants: PatchGridConstants) -> list[int]:
    """``fps`` frames per second of video, evenly spread: ``i * total // n`` (the reference's default sampler)."""
    total = probe.frame_count
    wanted = max(1, int(total / probe.fps * constants.fps)) if probe.fps > 0 else total
    count = min(wanted, total)
    return [i * total // count for i in range(count)]


class M3PromptSpec(PromptSpec):
    image_marker = image_token = "]<]image[>["
    video_marker = video_token = "]<]video[>["
    vision_start = "]<]start of image[>["
    vision_end = "]<]end of image[>["

    def __init__(self, temporal_patch_size: int, merge_size: int) -> None:
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size

    def image_text(self, plan: ImagePlan, tokens: int) -> str:
        return self.vision_start + self.image_token * tokens + self.vision_end

    def video_text(self, plan: VideoPlan, tokens: int) -> str:
        grid_t = sum(t for t, _, _ in plan.grids)
        _, grid_h, grid_w = plan.grids[0]
        per_frame = grid_h * grid_w // self.merge_size**2
        indices = plan.frame_indices
        parts = []
        for frame in range(grid_t):
            seconds = indices[min(frame * self.temporal_patch_size, len(indices) - 1)] / plan.fps
            parts.append(
                f"]<]{seconds:.1f} seconds[>[" + self.vision_start + self.video_token * per_frame + self.vision_end
            )
        return "".join(parts)


def constants_from_checkpoint(checkpoint: Path | None) -> PatchGridConstants:
    """The reference classes' defaults, overridden by the checkpoint's processor configs when present."""
    image, video = _processor_configs(checkpoint)
    c = DEFAULTS
    for config in (image, video):
        if config.get("resample", BICUBIC) != BICUBIC:
            raise ValueError(f"only bicubic resampling is implemented, the checkpoint asks for {config['resample']}")
        for switch in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(switch, True) is not True:
                raise ValueError(f"the checkpoint sets {switch}=false, which the gateway does not implement")
    image_min, image_max = _image_pixel_bounds(image, c)
    if video.get("patch_size", image.get("patch_size", c.patch_size)) != image.get("patch_size", c.patch_size):
        raise ValueError("the image and video processors disagree on patch_size")
    return PatchGridConstants(
        patch_size=image.get("patch_size", c.patch_size),
        temporal_patch_size=image.get("temporal_patch_size", c.temporal_patch_size),
        merge_size=image.get("merge_size", c.merge_size),
        image_min_pixels=image_min,
        image_max_pixels=image_max,
        video_min_pixels=video.get("min_pixels", c.video_min_pixels),
        video_max_pixels=video.get("max_pixels", c.video_max_pixels),
        image_mean=tuple(image.get("image_mean", c.image_mean)),
        image_std=tuple(image.get("image_std", c.image_std)),
        rescale_factor=image.get("rescale_factor", c.rescale_factor),
        fps=float(video.get("fps", c.fps)),
        min_frames=video.get("min_frames", c.min_frames),
        max_frames=video.get("max_frames", c.max_frames),
        vision_segment_max_frames=video.get("vision_segment_max_frames", c.vision_segment_max_frames),
    )


def _image_pixel_bounds(config: dict[str, Any], defaults: PatchGridConstants) -> tuple[int, int]:
    size = config.get("size")
    # The released checkpoints saved a size of [672, 672] that was never used; the reference ignores it.
    if not isinstance(size, dict):
        size = {}
    low = size.get("shortest_edge", size.get("min_pixels", defaults.image_min_pixels))
    high = size.get("longest_edge", size.get("max_pixels", defaults.image_max_pixels))
    return config.get("min_pixels", low), config.get("max_pixels", high)


def _processor_configs(checkpoint: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    if checkpoint is None:
        return {}, {}
    nested = _read_json(checkpoint / "processor_config.json")
    image = nested.get("image_processor") or _read_json(checkpoint / "preprocessor_config.json")
    video = nested.get("video_processor") or _read_json(checkpoint / "video_preprocessor_config.json")
    return image, video


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    logger.info("reading %s", path)
    return json.loads(path.read_text())


def profile(checkpoint: Path | None = None, resize_backend: ResizeBackend = ResizeBackend.AUTO) -> ModelProfile:
    constants = constants_from_checkpoint(checkpoint)
    return ModelProfile(
        MODEL_TYPE,
        PatchGridPreprocessor(constants, sample_frames, resize_backend),
        M3PromptSpec(constants.temporal_patch_size, constants.merge_size),
    )
