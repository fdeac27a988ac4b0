"""Generated test media: natural-looking images in every pixel mode, and videos encoded with PyAV."""

import contextlib
import io
import os
from collections.abc import Iterator
from fractions import Fraction

import av
import numpy as np
from PIL import Image


def natural_rgb(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth gradients and edges plus mild noise: resamplers disagree on it as they would on photos."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, 3)
    image = np.stack(
        [
            128 + 100 * np.sin(xx / (7 + width / 9) + phase[0]) * np.cos(yy / (5 + height / 11)),
            128 + 90 * np.cos((xx + yy) / (9 + (width + height) / 17) + phase[1]),
            128 + 80 * np.sin(yy / (3 + height / 7) + phase[2]),
        ],
        axis=-1,
    )
    top, left = rng.integers(0, max(1, height // 2)), rng.integers(0, max(1, width // 2))
    image[top : top + max(1, height // 4), left : left + max(1, width // 3)] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    return image.clip(0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, fmt: str, mode: str | None = None, exif_orientation: int | None = None) -> bytes:
    image = Image.fromarray(pixels)
    if mode == "RGBA":
        alpha = (np.arange(pixels.shape[1], dtype=np.uint16) * 255 // max(1, pixels.shape[1] - 1)).astype(np.uint8)
        image.putalpha(Image.fromarray(np.broadcast_to(alpha, pixels.shape[:2]).copy()))
    elif mode == "P":
        image = image.quantize(colors=64)
    elif mode is not None:
        image = image.convert(mode)
    buffer = io.BytesIO()
    options: dict = {"quality": 90} if fmt == "JPEG" else {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        options["exif"] = exif.tobytes()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


@contextlib.contextmanager
def keep_cpu_scheduling() -> Iterator[None]:
    """Restores the calling thread's CPU scheduling policy after the block.

    SVT-AV1 (``libsvtav1``) run as root switches the thread that opens the encoder to SCHED_FIFO at
    the highest priority.  Every process that thread starts afterwards (engines, the test control
    plane) inherits it, and a busy real-time process starves everything else on a 2-core machine.
    """
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, param)


def encode_video(
    width: int,
    height: int,
    frame_count: int,
    fps: int,
    codec: str = "libx264",
    *,
    container: str = "mp4",
    rotation: int = 0,
    variable_rate: bool = False,
    gop: int | None = None,
    seed: int = 0,
) -> bytes:
    """A moving pattern; ``variable_rate`` spaces frames irregularly (1/1000 s time base)."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with keep_cpu_scheduling(), av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        options = {"g": str(gop)} if gop else {}
        if codec == "libx264":
            options |= {"preset": "veryfast"}
        stream.options = options
        if variable_rate:
            stream.time_base = Fraction(1, 1000)
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        base = natural_rgb(height, width * 2, seed)
        pts = 0
        for index in range(frame_count):
            shift = (index * 3) % width
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(base[:, shift : shift + width]), format="rgb24")
            if variable_rate:
                frame.pts = pts
                frame.time_base = Fraction(1, 1000)
                pts += int(rng.choice([1000 // fps // 2, 1000 // fps, 3 * 1000 // fps // 2]))
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()
