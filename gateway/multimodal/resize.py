"""Output-size planning (Qwen-style ``smart_resize``) and the uint8 antialiased bicubic resize.

The reference processors resize uint8 tensors with torch's antialiased bicubic kernel (a = -0.5, the
support widened by the scale factor, horizontal pass first, rounded to uint8 between passes).  Two
backends produce that result:

* ``torch``: the very same kernel, bit-exact, when torch is importable (it is optional here: the
  gateway image does not need it);
* ``pillow``: Pillow's fixed-point bicubic, run as two single-axis passes in the same order as torch
  (Pillow's own two-axis resize may run the vertical pass first, which moves edge pixels by up to ~18
  levels); within 2 levels of torch, mean difference ~0.004 levels.
"""

import math
import warnings
from enum import StrEnum
from functools import cache

import numpy as np
from PIL import Image

from .errors import MediaError

MAX_ASPECT_RATIO = 200


class ResizeBackend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    PILLOW = "pillow"


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Both sides multiples of ``factor``, area within [min_pixels, max_pixels], aspect ratio kept as well
    as possible; Python's round-half-even like the reference.  Aspect ratios over 200 are refused."""
    if height <= 0 or width <= 0:
        raise MediaError(f"the image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"the aspect ratio of a {width}x{height} image exceeds {MAX_ASPECT_RATIO}:1", code="unsupported_media"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@cache
def _torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    # Pool workers run one job per process: extra intra-op threads would only fight each other.
    torch.set_num_threads(1)
    return True


def resolve_backend(backend: ResizeBackend) -> ResizeBackend:
    if backend is ResizeBackend.AUTO:
        return ResizeBackend.TORCH if _torch_available() else ResizeBackend.PILLOW
    if backend is ResizeBackend.TORCH and not _torch_available():
        raise RuntimeError("the torch resize backend was requested but torch is not installed")
    return backend


def resize_into(frame: np.ndarray, out: np.ndarray, backend: ResizeBackend) -> None:
    """One ``[H, W, 3]`` uint8 frame (any positive or negative strides) -> ``out``, a C-contiguous
    ``[height, width, 3]`` uint8 array (a copy when the size is unchanged)."""
    if not out.flags.c_contiguous or out.dtype != np.uint8 or out.shape[2:] != (3,):
        raise ValueError(f"the resize output must be a C-contiguous [H, W, 3] uint8 array, not {out.shape} {out.dtype}")
    if frame.shape[:2] == out.shape[:2]:
        out[...] = frame
    elif resolve_backend(backend) is ResizeBackend.TORCH:
        _resize_torch(frame, out)
    else:
        out[...] = _resize_pillow(np.ascontiguousarray(frame), *out.shape[:2])


def resize_frames(frames: np.ndarray, height: int, width: int, backend: ResizeBackend) -> np.ndarray:
    """``[N, H, W, 3]`` uint8 -> ``[N, height, width, 3]`` uint8 (the input itself when the size is unchanged)."""
    if frames.shape[1:3] == (height, width):
        return frames
    out = np.empty((frames.shape[0], height, width, 3), dtype=np.uint8)
    for frame, slot in zip(frames, out, strict=True):
        resize_into(frame, slot, backend)
    return out


def _resize_torch(frame: np.ndarray, out: np.ndarray) -> None:
    import torch

    if any(stride < 0 for stride in frame.strides):  # a rotated or flipped view: torch takes positive strides
        frame = np.ascontiguousarray(frame)
    with warnings.catch_warnings():
        # Decoded images are read-only arrays; the kernel only reads its input.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(frame).permute(2, 0, 1).unsqueeze(0)
    # Channels-last views on both sides: the uint8 kernel reads and writes that layout directly, whereas
    # ``interpolate`` returns planar output, repacked by a slow loop (about a third of the resize's time).
    # The same kernel as ``interpolate(mode="bicubic", antialias=True, align_corners=False)`` with a size.
    target = torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0)
    torch._C._nn._upsample_bicubic2d_aa(source, list(out.shape[:2]), False, None, None, out=target)


def _resize_pillow(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    image = Image.fromarray(frame)
    if image.width != width:
        image = image.resize((width, image.height), Image.Resampling.BICUBIC)
    if image.height != height:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)
