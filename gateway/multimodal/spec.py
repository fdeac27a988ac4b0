"""What a vision model supplies to the media pipeline, and the ordered registry of those models.

A model is two objects kept apart on purpose:

* a :class:`PixelPreprocessor` (pixel side): plans output sizes, sampled frames and token counts from
  image/video metadata alone, so limits and context checks run before any pixel is decoded, then
  writes one image or one video into a preallocated ``[num_patches, patch_dim]`` uint8 array;
* a :class:`PromptSpec` (prompt side): which marker each media part leaves in the templated prompt,
  what it expands to (special tokens, per-frame timestamps), and where the placeholders land.

The pipeline (``pipeline.py``) only talks to these interfaces, so adding a model is a new module
with its constants plus one :func:`register_profile` call.  Lookup is by ``config.json``
``model_type`` in registration order: no pattern matching over an unordered map.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import numpy as np

from .errors import MediaError

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


class PixelPreprocessor(ABC):
    """The pixel side of a model; implementations are pure and run inside pool workers."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A string that changes whenever any setting that affects the output changes (cache key)."""

    @abstractmethod
    def plan_image(self, height: int, width: int) -> ImagePlan:
        """Output size, grid and patch count for an upright ``height`` x ``width`` image."""

    @abstractmethod
    def plan_video(self, probe: VideoProbe) -> VideoPlan:
        """Sampled frame indices, output size and grids for a probed video."""

    @abstractmethod
    def run_image(self, rgb: np.ndarray, plan: ImagePlan, out: np.ndarray) -> None:
        """Write ``rgb`` (upright ``[H, W, 3]`` uint8) as patches into ``out`` ``[num_patches, patch_dim]`` uint8."""

    @abstractmethod
    def run_video(self, frames: Iterable[np.ndarray], plan: VideoPlan, out: np.ndarray) -> None:
        """Write the sampled frames (each ``[H, W, 3]`` uint8, upright, in order: a ``[T, H, W, 3]`` array or a
        decoder's stream) as patches into ``out``."""

    @abstractmethod
    def tokens_for(self, plan: Plan) -> int:
        """How many placeholder tokens the plan's embeddings fill."""

    @abstractmethod
    def normalize(self, patches: np.ndarray) -> np.ndarray:
        """uint8 patches -> the float32 values the vision tower takes (what the engine does for uint8 input)."""

    @abstractmethod
    def normalize_bfloat16(self, patches: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``normalize`` rounded to bfloat16 (nearest even) as uint16 bit patterns, written to ``out`` if given."""


@dataclass(frozen=True)
class PlaceholderSpan:
    """Prompt positions ``[offset, offset + length)`` filled with the item's embeddings."""

    offset: int
    length: int


class Tokenizer(Protocol):
    """What the prompt side needs from a tokenizer (``tokenizers.Tokenizer`` satisfies it)."""

    def token_to_id(self, token: str) -> int | None: ...


class PromptSpec(ABC):
    """The prompt side of a model: markers in, expanded text out, placeholder spans found."""

    image_marker: str  # what the chat template emits for one image part
    video_marker: str
    image_token: str  # the token repeated once per image embedding
    video_token: str

    @abstractmethod
    def image_text(self, plan: ImagePlan, tokens: int) -> str:
        """The text one image marker expands to."""

    @abstractmethod
    def video_text(self, plan: VideoPlan, tokens: int) -> str:
        """The text one video marker expands to (per-frame timestamps included)."""

    def expand_text(
        self, text: str, images: Sequence[tuple[ImagePlan, int]], videos: Sequence[tuple[VideoPlan, int]]
    ) -> str:
        """Replace the i-th image marker by the i-th image's expansion (same for videos), as the reference
        processor does before tokenizing.  A marker count that differs from the item count is a 400."""
        pieces = {
            self.image_marker: [self.image_text(p, n) for p, n in images],
            self.video_marker: [self.video_text(p, n) for p, n in videos],
        }
        for marker, replacements in pieces.items():
            found = text.count(marker)
            if found != len(replacements):
                kind = "image" if marker == self.image_marker else "video"
                raise MediaError(
                    f"the prompt has {found} {kind} placeholder(s) but the request has {len(replacements)} {kind}(s)"
                )
        return _replace_in_order(text, pieces)

    def placeholder_spans(
        self, token_ids: Sequence[int], tokenizer: Tokenizer, modalities: Sequence[str], token_counts: Sequence[int]
    ) -> list[list[PlaceholderSpan]]:
        """Per item (in prompt order: ``modalities[i]`` is ``"image"`` or ``"video"``), the maximal runs of its
        placeholder token in the tokenized expanded prompt; the runs must add up to ``token_counts[i]``."""
        ids = {m: _required_id(tokenizer, t) for m, t in (("image", self.image_token), ("video", self.video_token))}
        runs = _runs(np.asarray(token_ids, dtype=np.int64), ids)
        spans: list[list[PlaceholderSpan]] = []
        cursor = 0
        for modality, count in zip(modalities, token_counts, strict=True):
            item: list[PlaceholderSpan] = []
            covered = 0
            while covered < count:
                if cursor >= len(runs) or runs[cursor][0] != modality:
                    raise MediaError(
                        f"the tokenized prompt lacks the placeholders of a {modality} ({covered} of {count})"
                    )
                _, start, length = runs[cursor]
                item.append(PlaceholderSpan(start, length))
                covered += length
                cursor += 1
            if covered != count:
                raise MediaError(f"a {modality}'s placeholder runs cover {covered} tokens, expected {count}")
            spans.append(item)
        if cursor != len(runs):
            raise MediaError("the tokenized prompt has placeholder tokens that belong to no media item")
        return spans


def _replace_in_order(text: str, pieces: dict[str, list[str]]) -> str:
    markers = [m for m, r in pieces.items() if r]
    if not markers:
        return text
    iterators = {m: iter(r) for m, r in pieces.items()}
    out: list[str] = []
    position = 0
    while True:
        hits = [(text.find(m, position), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            break
        index, marker = min(hits)
        out.append(text[position:index])
        out.append(next(iterators[marker]))
        position = index + len(marker)
    out.append(text[position:])
    return "".join(out)


def _required_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token!r} token")
    return token_id


def _runs(ids: np.ndarray, by_modality: dict[str, int]) -> list[tuple[str, int, int]]:
    """(modality, start, length) of each maximal run of a placeholder id, in prompt order."""
    runs = []
    for modality, token_id in by_modality.items():
        mask = np.concatenate([[False], ids == token_id, [False]])
        edges = np.flatnonzero(mask[1:] != mask[:-1])
        runs += [(modality, int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2], strict=True)]
    return sorted(runs, key=lambda run: run[1])


@dataclass(frozen=True)
class ModelProfile:
    """One model's pixel side and prompt side."""

    model_type: str
    preprocessor: PixelPreprocessor
    prompt: PromptSpec


ProfileFactory = Callable[[Path | None], ModelProfile]


@dataclass
class ProfileRegistry:
    """``model_type`` -> profile factory, first registration wins; factories read the checkpoint folder."""

    _entries: list[tuple[str, ProfileFactory]] = field(default_factory=list)

    def register(self, model_type: str, factory: ProfileFactory) -> None:
        if any(name == model_type for name, _ in self._entries):
            raise ValueError(f"a profile for model_type {model_type!r} is already registered")
        self._entries.append((model_type, factory))

    def model_types(self) -> list[str]:
        return [name for name, _ in self._entries]

    def load(self, model_type: str, checkpoint: Path | None = None) -> ModelProfile:
        for name, factory in self._entries:
            if name == model_type:
                return factory(checkpoint)
        raise KeyError(f"no multimodal profile for model_type {model_type!r}; known: {', '.join(self.model_types())}")


REGISTRY = ProfileRegistry()


def register_profile(model_type: str, factory: ProfileFactory) -> None:
    REGISTRY.register(model_type, factory)


def load_profile(model_type: str, checkpoint: Path | None = None) -> ModelProfile:
    """The profile for a checkpoint's ``model_type`` (importing the built-in profiles first)."""
    from . import profiles  # noqa: F401  (registers the built-in models)

    return REGISTRY.load(model_type, checkpoint)
