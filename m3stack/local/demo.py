"""``m3stack up --demo``: one text, one image and one video request through the OpenAI API."""

import base64
import io
import logging
import time
from typing import Any

import httpx

logger = logging.getLogger(__name__)

DEMO_MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 300.0


def demo_image_png(width: int = 320, height: int = 240) -> bytes:
    """A colour gradient with a square: real pixels, made here, no download."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
    rgb[height // 3 : 2 * height // 3, width // 3 : 2 * width // 3] = (250, 250, 20)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def demo_video_mp4(seconds: int = 3, fps: int = 8, width: int = 160, height: int = 120) -> bytes:
    """A square moving across a gradient, H.264 (or MPEG-4 Part 2 where H.264 is missing) via PyAV."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(seconds * fps):
            frame = np.full((height, width, 3), 40, dtype=np.uint8)
            frame[:, :, 2] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
            left = index * (width - 32) // (seconds * fps)
            frame[height // 2 - 16 : height // 2 + 16, left : left + 32] = (255, 80, 80)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def demo_requests() -> list[tuple[str, list[dict[str, Any]]]]:
    image = data_url("image/png", demo_image_png())
    video = data_url("video/mp4", demo_video_mp4())
    return [
        ("text", [{"type": "text", "text": "Write one sentence about sparse attention."}]),
        (
            "image",
            [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe the image."}],
        ),
        ("video", [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": "What moves?"}]),
    ]


def run_demo(base_url: str, model: str) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is ours to print
    logger.info("demo: the default model has RANDOM weights, so the answers below are random tokens")
    failures = 0
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        for kind, content in demo_requests():
            body = {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": DEMO_MAX_TOKENS,
                "temperature": 0,
            }
            start = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if response.status_code != 200:
                failures += 1
                logger.error("demo %s request failed: HTTP %d %s", kind, response.status_code, response.text[:500])
                continue
            payload = response.json()
            usage = payload.get("usage", {})
            logger.info(
                "demo %-5s %7.0f ms  prompt %4s tokens, completion %3s tokens: %r",
                kind,
                elapsed_ms,
                usage.get("prompt_tokens"),
                usage.get("completion_tokens"),
                payload["choices"][0]["message"]["content"],
            )
    return 1 if failures else 0
