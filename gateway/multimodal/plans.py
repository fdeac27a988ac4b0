"""What a model plans for one image or video from its metadata alone, before any pixel is decoded.

The pixel side of a model (``model_profile.PixelPreprocessor``) turns an image's size or a video's probe into a
plan: output size, sampled frames, patch grids.  Limits, the context check and the cache key all work from these.
"""

from dataclasses import dataclass
from fractions import Fraction

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ImagePlan:
    """Everything about one image's output, known from its size alone."""

    source_height: int  # upright (after EXIF orientation)
    source_width: int
    height: int  # resized
    width: int
    grids: tuple[Grid, ...]  # one (t, h, w) in patches for an image
    patch_dim: int

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)


@dataclass(frozen=True)
class VideoProbe:
    """A video's metadata, read by demuxing (no full decode).

    ``frame_pts`` lists every frame's presentation timestamp in presentation order, so frame index i
    (the i-th decoded frame, the reference's notion of a frame) maps to a timestamp even under a
    variable frame rate; ``keyframe_pts`` are the random-access points a seek can land on.
    """

    codec: str
    width: int  # coded size, before rotation
    height: int
    rotation: int  # counter-clockwise degrees to display upright: 0, 90, 180 or 270
    fps: float  # the container's average frame rate (what the reference samples with)
    time_base: Fraction
    frame_pts: tuple[int, ...]
    keyframe_pts: tuple[int, ...]

    @property
    def frame_count(self) -> int:
        return len(self.frame_pts)

    @property
    def display_size(self) -> tuple[int, int]:
        """(height, width) after rotation."""
        return (self.width, self.height) if self.rotation in (90, 270) else (self.height, self.width)

    @property
    def duration_s(self) -> float:
        return self.frame_count / self.fps if self.fps > 0 else 0.0


@dataclass(frozen=True)
class VideoPlan:
    """The sampled frames of one video and its output, known from the probe alone."""

    frame_indices: tuple[int, ...]  # into VideoProbe.frame_pts, ascending
    source_height: int  # upright
    source_width: int
    height: int  # resized
    width: int
    grids: tuple[Grid, ...]  # vision-attention segments, concatenated along t
    patch_dim: int
    fps: float  # of the source, for the prompt's timestamps

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)


Plan = ImagePlan | VideoPlan
