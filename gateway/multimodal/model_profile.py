"""What a vision model supplies to the media pipeline: its pixel side and its prompt side.

A model is two objects kept apart on purpose:

* a :class:`PixelPreprocessor` (pixel side): plans output sizes, sampled frames and token counts from
  image/video metadata alone, so limits and context checks run before any pixel is decoded, then
  writes one image or one video into a preallocated ``[num_patches, patch_dim]`` uint8 array;
* a :class:`PromptSpec` (prompt side): which marker each media part leaves in the templated prompt,
  what it expands to (special tokens, per-frame timestamps), and where the placeholders land.

The pipeline (``pipeline.py``) only talks to these interfaces, so adding a model is a new module
with its constants plus one line in ``registry.py``.
"""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import MediaError
from .plans import ImagePlan, Plan, VideoPlan, VideoProbe


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
