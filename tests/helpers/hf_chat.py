"""transformers' M3 processor and model as the oracle for one chat turn with images and videos."""

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from tests.engine.model.hf_oracle import hf_greedy


class DecodedVideo(Protocol):
    frames: np.ndarray  # [frames, height, width, 3] rgb24, upright
    total_num_frames: int
    fps: float


def hf_chat_greedy(
    processor: Any,
    model: Any,
    content: list[dict[str, Any]],
    num_tokens: int,
    images: Sequence[Image.Image] = (),
    videos: Sequence[DecodedVideo] = (),
) -> tuple[list[int], int]:
    """Greedy ids of the answer to one user turn, and the prompt's length in tokens.

    ``content`` is the turn in HF's form (``{"type": "image"}``, ``{"type": "video"}``, ``{"type": "text", ...}``),
    with ``images`` and ``videos`` in the order their placeholders appear; videos are sampled by fps, as the
    gateway does."""
    from transformers.video_utils import VideoMetadata

    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    media: dict[str, Any] = {}
    if images:
        media["images"] = list(images)
    if videos:
        media["videos"] = [video.frames for video in videos]
        media["video_metadata"] = [VideoMetadata(total_num_frames=v.total_num_frames, fps=v.fps) for v in videos]
        media["videos_kwargs"] = {"do_resize": True, "do_sample_frames": True}
    inputs = processor(text=[text], return_tensors="pt", **media)
    multimodal = {
        key: inputs[key]
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        if key in inputs
    }
    prompt = inputs["input_ids"][0]
    _, tokens = hf_greedy(model, prompt, num_tokens, **multimodal)
    return tokens, int(prompt.shape[0])


def load_hf_model(model_dir: Any) -> Any:
    """The checkpoint in transformers, float32 on CPU, for :func:`hf_chat_greedy`."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
