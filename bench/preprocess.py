"""Media preprocessing: the gateway's image/video path against the HF reference on the same inputs.

Cases (the issue's): a 1280x960 JPEG, and a 20 s 1280x720 H.264 clip at 30 fps, the latter with the
three keyframe spacings met in practice (libx264's default of up to 250 frames, 2 s, 1 s), since how
much of a video must be decoded depends on where its keyframes are.

* ours: what one pool worker runs for an item (decode, plan, resize, patchify) into uint8 patches
  (the wire format; the engine normalizes), video decoded sparsely with one thread.  An extra row
  gives the image with bfloat16 normalized output, and one with the torch-free Pillow resize.
* reference: ``MiniMaxM3VLImageProcessor`` on the file (its own libjpeg-turbo decode), and HF's PyAV
  loader (``read_video_pyav``, sampling with the processor's ``sample_frames``) plus
  ``MiniMaxM3VLVideoProcessor``: float32 normalized output.  (M3 has no slow/PIL processor.)

Both sides run single-threaded, as a gateway under load runs one job per core: torch with one thread,
our decoder with one thread, the reference's PyAV loader at its defaults (slice threading, which
these one-slice-per-frame H.264 streams cannot use).  Times are medians of interleaved repetitions,
in CPU milliseconds of this process (``time.process_time``): this machine's 2 cores are shared, and
wall time there measures the neighbours.  Wall medians are recorded too.  Every run first checks the outputs are equal
(patches within HF's slow/fast tolerance after normalization, same grids and sampled frames).

    python -m bench.preprocess [--repeats-image 30] [--repeats-video 3]

Writes ``bench/results/preprocess.json``.  Target: reference_ms / ours_ms >= 3 for image and video.
"""

import argparse
import functools
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from bench.common import markdown_table, write_results
from m3stack.gateway.multimodal import m3
from m3stack.gateway.multimodal import video as video_codec
from m3stack.gateway.multimodal.image import decode_image, probe_image
from m3stack.gateway.multimodal.resize import ResizeBackend

logger = logging.getLogger("bench.preprocess")
MEDIA_CACHE = Path(tempfile.gettempdir()) / "m3stack-bench-media"
VIDEO_GOPS = {"x264-default-gop": None, "gop-2s": 60, "gop-1s": 30}


def synthetic_photo(height: int, width: int, seed: int) -> np.ndarray:
    """Gradients, edges and sensor-like noise: compresses and resamples like a photo, not like a flat test card."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack(
        [
            128 + 100 * np.sin(xx / 53.0) * np.cos(yy / 41.0),
            128 + 90 * np.cos((xx + 2 * yy) / 37.0),
            128 + 80 * np.sin((xx - yy) / 29.0),
        ],
        axis=-1,
    )
    for _ in range(12):
        top, left = rng.integers(0, height - 60), rng.integers(0, width - 80)
        image[top : top + rng.integers(20, 200), left : left + rng.integers(20, 300)] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 5, image.shape)
    return image.clip(0, 255).astype(np.uint8)


def make_jpeg() -> Path:
    path = MEDIA_CACHE / "photo-1280x960-q90.jpg"
    if not path.exists():
        Image.fromarray(synthetic_photo(960, 1280, 0)).save(path, "JPEG", quality=90)
    return path


def make_video(gop: int | None) -> Path:
    """20 s of 1280x720 at 30 fps, libx264 defaults (preset medium, CRF 23) apart from the keyframe spacing."""
    path = MEDIA_CACHE / f"clip-1280x720-30fps-20s-gop{gop or 'default'}.mp4"
    if path.exists():
        return path
    width, height, fps = 1280, 720, 30
    scene = synthetic_photo(height + 200, width + 600, 1)
    with av.open(str(path), mode="w") as output:
        stream = output.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": str(gop), "keyint_min": str(gop)} if gop else {}
        for index in tqdm(range(20 * fps), desc=f"encoding {path.name}", leave=False):
            x, y = (index * 2) % 600, int(100 + 80 * np.sin(index / 40))
            frame = np.ascontiguousarray(scene[y : y + height, x : x + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


# ---------------------------------------------------------------------------------------------
# The two sides


def ours_image(data: bytes, preprocessor, normalized: bool = False) -> np.ndarray:
    header = probe_image(data)
    plan = preprocessor.plan_image(header.height, header.width)
    out = np.empty((plan.num_patches, plan.patch_dim), dtype=np.uint8)
    preprocessor.run_image(decode_image(data, header=header), plan, out)
    return preprocessor.normalize_bfloat16(out) if normalized else out


def ours_video(data: bytes, preprocessor) -> tuple[np.ndarray, tuple[int, ...]]:
    probe = video_codec.probe_video(data, max_frame_pixels=10**8, max_frames=10**6)
    plan = preprocessor.plan_video(probe)
    out = np.empty((plan.num_patches, plan.patch_dim), dtype=np.uint8)
    preprocessor.run_video(video_codec.iter_frames(data, probe, plan.frame_indices, threads=1), plan, out)
    return out, plan.frame_indices


def reference_image(path: Path, processor) -> np.ndarray:
    return processor(str(path), return_tensors="pt")["pixel_values"]


def reference_video(path: Path, processor) -> tuple[Any, list[int]]:
    from transformers.video_utils import read_video_pyav

    frames, metadata = read_video_pyav(str(path), functools.partial(processor.sample_frames, fps=processor.fps))
    output = processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_metadata=True)
    return output["pixel_values_videos"], list(metadata.frames_indices)


# ---------------------------------------------------------------------------------------------


def measure(functions: dict[str, Callable[[], Any]], repeats: int, label: str) -> dict[str, dict[str, float]]:
    """Interleaved repetitions; median CPU and wall milliseconds per function."""
    cpu: dict[str, list[float]] = {name: [] for name in functions}
    wall: dict[str, list[float]] = {name: [] for name in functions}
    for _ in tqdm(range(repeats), desc=label, leave=False):
        for name, function in functions.items():
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            function()
            cpu[name].append((time.process_time() - cpu_start) * 1e3)
            wall[name].append((time.perf_counter() - wall_start) * 1e3)
    return {
        name: {
            "cpu_ms": statistics.median(cpu[name]),
            "cpu_min_ms": min(cpu[name]),
            "wall_ms": statistics.median(wall[name]),
        }
        for name in functions
    }


def check_equal(ours_normalized: np.ndarray, reference: torch.Tensor, label: str) -> float:
    """HF's slow/fast tolerance; returns the max absolute difference."""
    reference_array = reference.float().numpy()
    torch.testing.assert_close(torch.from_numpy(ours_normalized), reference.float(), atol=0.1, rtol=1e-3)
    mean = float(np.abs(ours_normalized - reference_array).mean())
    assert mean <= 5e-3, f"{label}: mean difference {mean}"
    return float(np.abs(ours_normalized - reference_array).max())


def row(case: str, ours: dict[str, float], reference: dict[str, float], max_difference: float, **extra: Any) -> dict:
    return {
        "case": case,
        "ours_ms": round(ours["cpu_ms"], 2),
        "reference_ms": round(reference["cpu_ms"], 2),
        "speedup": round(reference["cpu_ms"] / ours["cpu_ms"], 2),
        "ours_min_ms": round(ours["cpu_min_ms"], 2),
        "reference_min_ms": round(reference["cpu_min_ms"], 2),
        "ours_wall_ms": round(ours["wall_ms"], 2),
        "reference_wall_ms": round(reference["wall_ms"], 2),
        "max_abs_difference_normalized": max_difference,
        **extra,
    }


def bench_image(repeats: int) -> list[dict]:
    from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor

    path = make_jpeg()
    data = path.read_bytes()
    reference = MiniMaxM3VLImageProcessor()
    fast = m3.profile(resize_backend=ResizeBackend.TORCH).preprocessor
    portable = m3.profile(resize_backend=ResizeBackend.PILLOW).preprocessor
    expected = reference_image(path, reference)
    differences = {
        name: check_equal(p.normalize(ours_image(data, p)), expected, name)
        for name, p in (("torch", fast), ("pillow", portable))
    }
    times = measure(
        {
            "reference": lambda: reference_image(path, reference),
            "ours": lambda: ours_image(data, fast),
            "ours_bf16": lambda: ours_image(data, fast, normalized=True),
            "ours_pillow": lambda: ours_image(data, portable),
        },
        repeats,
        "image",
    )
    name = "image 1280x960 JPEG"
    return [
        row(name, times["ours"], times["reference"], differences["torch"], output="uint8", resize="torch"),
        row(f"{name}, bf16 out", times["ours_bf16"], times["reference"], differences["torch"], output="bf16"),
        row(f"{name}, Pillow resize", times["ours_pillow"], times["reference"], differences["pillow"], resize="pillow"),
    ]


def bench_video(repeats: int) -> list[dict]:
    from transformers.models.minimax_m3_vl import MiniMaxM3VLVideoProcessor

    reference = MiniMaxM3VLVideoProcessor(fps=m3.DEFAULTS.fps)
    preprocessor = m3.profile(resize_backend=ResizeBackend.TORCH).preprocessor
    rows = []
    for label, gop in VIDEO_GOPS.items():
        path = make_video(gop)
        data = path.read_bytes()
        ours, indices = ours_video(data, preprocessor)
        expected, reference_indices = reference_video(path, reference)
        assert list(indices) == reference_indices, "different frames sampled"
        difference = check_equal(preprocessor.normalize(ours), expected, label)
        probe = video_codec.probe_video(data, max_frame_pixels=10**8, max_frames=10**6)
        walk = video_codec.frames_to_decode(probe, video_codec.plan_decode(probe, indices))
        stats = video_codec.DecodeStats()
        for _ in video_codec.iter_frames(data, probe, indices, threads=1, stats=stats):
            pass
        times = measure(
            {
                "reference": lambda p=path: reference_video(p, reference),
                "ours": lambda d=data: ours_video(d, preprocessor),
            },
            repeats,
            label,
        )
        rows.append(
            row(
                f"video H.264 1280x720 20 s 30 fps, {label}",
                times["ours"],
                times["reference"],
                difference,
                megabits_per_s=round(len(data) * 8 / 20 / 1e6, 2),
                keyframes=len(probe.keyframe_pts),
                frames_walked=walk,
                frames_decoded=stats.frames,  # reconstructed: the walk less the non-reference frames skipped
                frames_sampled=len(indices),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats-image", type=int, default=30)
    parser.add_argument("--repeats-video", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    MEDIA_CACHE.mkdir(parents=True, exist_ok=True)
    rows = bench_image(args.repeats_image) + bench_video(args.repeats_video)
    write_results("preprocess", rows, {"time": "median CPU ms of this process, single-threaded both sides"}, args.out)
    columns = ["case", "ours_ms", "reference_ms", "speedup", "frames_walked", "frames_decoded"]
    logger.info("\n%s", markdown_table(rows, columns))


if __name__ == "__main__":
    main()
