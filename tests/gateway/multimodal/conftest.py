"""Reference (HF transformers) runners and shared fixtures for the media pipeline tests."""

import base64
import io
from dataclasses import dataclass

import av
import numpy as np
import pytest
import torch

from m3stack.gateway.multimodal import m3
from m3stack.gateway.multimodal.patch_grid import PatchGridConstants, PatchGridPreprocessor
from m3stack.gateway.multimodal.resize import ResizeBackend

torch.set_num_threads(1)

# HF's own slow-vs-fast tolerance for processors (normalized values): torch.testing.assert_close with
# atol=1e-1, rtol=1e-3, and a mean absolute difference of at most 5e-3.
REFERENCE_ATOL = 1e-1
REFERENCE_RTOL = 1e-3
REFERENCE_MEAN_ATOL = 5e-3


def assert_within_reference_tolerance(ours: np.ndarray, reference: np.ndarray) -> None:
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(ours, dtype=np.float32)),
        torch.from_numpy(np.asarray(reference, dtype=np.float32)),
        atol=REFERENCE_ATOL,
        rtol=REFERENCE_RTOL,
    )
    mean = float(np.abs(np.asarray(ours, np.float64) - np.asarray(reference, np.float64)).mean())
    assert mean <= REFERENCE_MEAN_ATOL, f"mean absolute difference {mean} > {REFERENCE_MEAN_ATOL}"


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass
class ReferenceVideo:
    frames: np.ndarray  # every decoded frame, upright
    total_num_frames: int
    fps: float


def reference_decode_video(data: bytes) -> ReferenceVideo:
    """All frames as the reference's PyAV loader decodes them (rgb24), rotated upright like torchcodec does."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = []
        rotation = 0
        for frame in container.decode(stream):
            rotation = round(frame.rotation / 90) % 4
            frames.append(np.rot90(frame.to_ndarray(format="rgb24"), rotation))
        # WebM/Matroska store no frame count (stream.frames == 0) and the reference loader then cannot
        # sample at all; the decoded count is what the gateway's packet count gives.
        total = int(stream.frames) or len(frames)
        return ReferenceVideo(np.stack(frames), total, float(stream.average_rate))


def reference_image_processor(**overrides):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor

    return MiniMaxM3VLImageProcessor(**overrides)


def reference_video_processor(**overrides):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLVideoProcessor

    return MiniMaxM3VLVideoProcessor(**overrides)


def run_reference_video(video: ReferenceVideo, processor, *, raw: bool):
    """The HF video processor on decoded frames with fps sampling (what the gateway always does)."""
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(total_num_frames=video.total_num_frames, fps=video.fps)
    extra = {"do_rescale": False, "do_normalize": False} if raw else {}
    output = processor(
        videos=[video.frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True, **extra
    )
    return {key: value.numpy() if isinstance(value, torch.Tensor) else value for key, value in output.items()}


@pytest.fixture(scope="session")
def m3_profiles():
    """The M3 profile with each resize backend (torch: bit-exact kernel; pillow: the torch-free path)."""
    return {backend: m3.profile(resize_backend=backend) for backend in (ResizeBackend.TORCH, ResizeBackend.PILLOW)}


def m3_preprocessor(backend: ResizeBackend, **constants) -> PatchGridPreprocessor:
    """The M3 pixel side with some constants changed (e.g. a faster ``fps`` so short videos sample more)."""
    fields = {**m3.DEFAULTS.__dict__, **constants}
    return PatchGridPreprocessor(PatchGridConstants(**fields), m3.sample_frames, backend)
