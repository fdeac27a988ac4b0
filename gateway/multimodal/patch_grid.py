"""The pixel side shared by patch-grid vision towers (Qwen2-VL family, MiniMax-M3): constants in, plans and
patches out.  A model supplies a :class:`PatchGridConstants` and a frame sampler; nothing else differs."""

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from .errors import MediaError
from .model_profile import PixelPreprocessor
from .patchify import float32_to_bfloat16_bits, normalization_table, normalize_patches, patchify_into
from .plans import ImagePlan, Plan, VideoPlan, VideoProbe
from .resize import ResizeBackend, resize_frames, resize_into, smart_resize

# OpenAI CLIP's pixel mean and std: the normalization of both built-in towers (and their processors' defaults).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# (probe, constants) -> ascending indices into probe.frame_pts
FrameSampler = Callable[[VideoProbe, "PatchGridConstants"], list[int]]


@dataclass(frozen=True)
class PatchGridConstants:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    fps: float  # frames sampled per second of video
    min_frames: int
    max_frames: int
    # Temporal patches per vision-attention segment of a video; None keeps one segment.
    vision_segment_max_frames: int | None

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


class PatchGridPreprocessor(PixelPreprocessor):
    def __init__(
        self, constants: PatchGridConstants, sampler: FrameSampler, resize_backend: ResizeBackend = ResizeBackend.AUTO
    ) -> None:
        self.constants = constants
        self.sampler = sampler
        self.resize_backend = resize_backend
        self._table = normalization_table(constants.image_mean, constants.image_std, constants.rescale_factor)
        self._bfloat16_table = float32_to_bfloat16_bits(self._table)

    def fingerprint(self) -> str:
        settings = {**asdict(self.constants), "sampler": self.sampler.__qualname__}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    def plan_image(self, height: int, width: int) -> ImagePlan:
        c = self.constants
        resized_h, resized_w = smart_resize(height, width, c.factor, c.image_min_pixels, c.image_max_pixels)
        grid = (1, resized_h // c.patch_size, resized_w // c.patch_size)
        return ImagePlan(height, width, resized_h, resized_w, (grid,), c.patch_dim)

    def plan_video(self, probe: VideoProbe) -> VideoPlan:
        c = self.constants
        if probe.frame_count == 0:
            raise MediaError("the video has no frames")
        indices = self.sampler(probe, c)
        height, width = probe.display_size
        resized_h, resized_w = smart_resize(height, width, c.factor, c.video_min_pixels, c.video_max_pixels)
        grid_t = -(-len(indices) // c.temporal_patch_size)
        grid_h, grid_w = resized_h // c.patch_size, resized_w // c.patch_size
        segment = grid_t if c.vision_segment_max_frames is None else c.vision_segment_max_frames
        grids = tuple((min(segment, grid_t - start), grid_h, grid_w) for start in range(0, grid_t, segment))
        return VideoPlan(tuple(indices), height, width, resized_h, resized_w, grids, c.patch_dim, probe.fps)

    def run_image(self, rgb: np.ndarray, plan: ImagePlan, out: np.ndarray) -> None:
        resized = resize_frames(rgb[None], plan.height, plan.width, self.resize_backend)
        self._patchify(resized, out)

    def run_video(self, frames: Iterable[np.ndarray], plan: VideoPlan, out: np.ndarray) -> None:
        """Frames are resized as they arrive and patchified one temporal group at a time, so a decoder can
        stream them in: only ``temporal_patch_size`` resized frames are held, never the whole clip."""
        c = self.constants
        count = len(plan.frame_indices)
        group = np.empty((c.temporal_patch_size, plan.height, plan.width, 3), dtype=np.uint8)
        rows = (plan.height // c.patch_size) * (plan.width // c.patch_size)
        received = 0
        for frame in frames:
            if received == count:
                raise ValueError(f"more frames than the plan's {count}")
            slot = received % c.temporal_patch_size
            resize_into(frame, group[slot], self.resize_backend)
            received += 1
            if slot == c.temporal_patch_size - 1 or received == count:
                start = (received - 1) // c.temporal_patch_size * rows
                self._patchify(group[: slot + 1], out[start : start + rows])
        if received != count:
            raise ValueError(f"{received} frames for a plan of {count}")

    def tokens_for(self, plan: Plan) -> int:
        return plan.num_patches // self.constants.merge_size**2

    def normalize(self, patches: np.ndarray) -> np.ndarray:
        return normalize_patches(patches, self._table)

    def normalize_bfloat16(self, patches: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return normalize_patches(patches, self._bfloat16_table, out)

    def _patchify(self, frames: np.ndarray, out: np.ndarray) -> None:
        c = self.constants
        patchify_into(frames, out, c.patch_size, c.merge_size, c.temporal_patch_size)
