"""The whole pipeline through real worker processes: outputs equal the reference, limits refuse early,
bad media is a 400 that leaves the pipeline serving, the cache and both transports work."""

import asyncio
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from m3stack.engine.server.convert import mm_items_from_proto
from m3stack.gateway.engine_client import wire
from m3stack.gateway.multimodal import (
    MediaError,
    MediaLimits,
    MediaPart,
    MediaPipeline,
    PlacedItem,
    PlaceholderSpan,
    Transport,
    WireDType,
    load_profile,
)
from m3stack.gateway.multimodal.pipeline import probe_image_job, process_job, warm_worker
from m3stack.gateway.multimodal.pool import WorkerPool
from m3stack.gateway.multimodal.resize import ResizeBackend
from m3stack.gateway.multimodal.transport import (
    SHM_DIR,
    map_segment,
    new_segment_name,
    unlink_segment,
    write_segment,
)
from m3stack.proto import engine_pb2

from .conftest import (
    data_url,
    m3_preprocessor,
    reference_decode_video,
    reference_image_processor,
    reference_video_processor,
    run_reference_video,
)
from .media_factory import encode_image, encode_video, natural_rgb

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as loop_runner:
        yield loop_runner


@pytest.fixture(scope="module")
def pool(runner):
    workers = WorkerPool(workers=1, warmup=warm_worker)
    runner.run(workers.start())
    yield workers
    runner.run(workers.close())


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def make_pipeline(runner, pool, media_dir):
    made = []

    def make(profile=None, **limits) -> MediaPipeline:
        settings = {"local_media_dir": str(media_dir), **limits}
        pipeline = MediaPipeline(profile or load_profile("minimax_m3_vl"), MediaLimits(**settings), pool=pool)
        made.append(pipeline)
        return pipeline

    yield make
    for pipeline in made:
        runner.run(pipeline.close())


@pytest.fixture(scope="module")
def image_bytes():
    return encode_image(natural_rgb(480, 640, 11), "JPEG")


@pytest.fixture(scope="module")
def video_path(media_dir):
    path = media_dir / "clip.mp4"
    path.write_bytes(encode_video(160, 96, 100, 25, seed=12))  # 4 s at 25 fps
    return path


def test_image_and_video_equal_the_reference(runner, make_pipeline, image_bytes, video_path):
    pipeline = make_pipeline()
    url = data_url(image_bytes, "image/jpeg")
    parts = [MediaPart("image", url), MediaPart("video", f"file://{video_path}")]
    image, video = runner.run(pipeline.process_media(parts))

    raw_image = reference_image_processor()(url, do_rescale=False, do_normalize=False, return_tensors="np")
    np.testing.assert_array_equal(image.patches(), raw_image["pixel_values"])
    assert image.num_tokens == int(raw_image["image_grid_thw"].prod()) // 4

    decoded = reference_decode_video(video_path.read_bytes())
    raw_video = run_reference_video(decoded, reference_video_processor(), raw=True)
    np.testing.assert_array_equal(video.patches(), raw_video["pixel_values_videos"])
    assert [list(g) for g in video.plan.grids] == raw_video["video_grid_thw"].tolist()

    (placed,) = pipeline.place([video], [[PlaceholderSpan(5, 3), PlaceholderSpan(12, 3)]])
    proto = wire.multimodal_item(placed)
    assert proto.modality == engine_pb2.MODALITY_VIDEO
    assert [[g.t, g.h, g.w] for g in proto.grids] == raw_video["video_grid_thw"].tolist()
    assert proto.pixel_values.dtype == engine_pb2.DTYPE_UINT8
    assert list(proto.pixel_values.shape) == list(video.shape)
    assert proto.pixel_values.inline_data == video.payload
    assert [(p.offset, p.length) for p in proto.placeholders] == [(5, 3), (12, 3)]
    assert proto.content_hash == video.content_hash != image.content_hash


def test_repeated_media_comes_from_the_cache(runner, make_pipeline, image_bytes):
    pipeline = make_pipeline()
    part = MediaPart("image", data_url(image_bytes, "image/jpeg"))
    (first,) = runner.run(pipeline.process_media([part]))
    (second,) = runner.run(pipeline.process_media([part]))
    assert (pipeline.cache.hits, pipeline.cache.misses) == (1, 1)
    assert second.payload == first.payload and second.content_hash == first.content_hash


def test_shared_memory_transport_hands_the_segment_to_the_engine(runner, make_pipeline, image_bytes):
    pipeline = make_pipeline()
    (item,) = runner.run(pipeline.process_media([MediaPart("image", data_url(image_bytes, "image/jpeg"))]))
    proto = wire.multimodal_item(PlacedItem(item, (), Transport(shm_threshold_bytes=1024)))
    assert proto.pixel_values.WhichOneof("payload") == "shm"
    name = proto.pixel_values.shm.name
    assert (SHM_DIR / name).exists() and proto.pixel_values.shm.nbytes == len(item.payload)
    (received,) = mm_items_from_proto([proto], max_tensor_bytes=1 << 30)  # the engine: read, then unlink
    assert received.pixel_values.numpy().tobytes() == item.payload
    assert not (SHM_DIR / name).exists()


def _own_segments() -> list[str]:
    """Shared-memory segments made by this test process or its worker processes.

    Segment names carry the creating pid; other xdist workers run pipelines at the same time, so
    their segments must not count here.
    """
    own = {os.getpid()}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == os.getpid():
            own.add(int(stat.parent.name))
    return [path.name for path in SHM_DIR.glob("m3stack-mm-*") if int(path.name.split("-")[2]) in own]


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


BAD_MEDIA = {
    "garbage-image": ("image", lambda image, video: b"\x00not an image at all" * 10, "not an image"),
    "truncated-jpeg": ("image", lambda image, video: _truncated(image), "corrupt or truncated"),
    "video-as-image": ("image", lambda image, video: video, "not an image"),
    "garbage-video": ("video", lambda image, video: b"\x00\x01garbage" * 100, "not a video"),
    "truncated-mp4": ("video", lambda image, video: _truncated(video), "not a video"),
    "image-as-video": ("video", lambda image, video: image, "not a video in a supported container"),
}


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_a_400_and_the_pipeline_keeps_serving(case, runner, make_pipeline, image_bytes, video_path):
    modality, corrupt, message = BAD_MEDIA[case]
    pipeline = make_pipeline()
    bad = corrupt(image_bytes, video_path.read_bytes())
    part = MediaPart(modality, data_url(bad, "application/octet-stream"), param="messages[0].content[1]")
    with pytest.raises(MediaError, match=message) as error:
        runner.run(pipeline.process_media([part]))
    assert error.value.status == 400 and error.value.param == "messages[0].content[1]"
    (item,) = runner.run(pipeline.process_media([MediaPart("image", data_url(image_bytes, "image/jpeg"))]))
    assert item.num_tokens > 0
    assert not _own_segments(), "segments of failed requests must be removed"


@pytest.mark.parametrize(
    ("limits", "budget", "code", "message"),
    [
        ({"max_image_pixels": 640 * 480 - 1}, None, "media_too_large", "exceeds the limit"),
        ({"max_images": 1}, None, "too_many_media_items", "2 images exceed"),
        ({}, 100, "context_length_exceeded", "leaves room for 100"),
        ({"max_sampled_frames": 3}, None, "media_too_large", "sampling would take 4 frames"),
        ({"max_video_pixels": 4 * 96 * 160 - 1}, None, "media_too_large", "4 sampled frames of 160x96"),
        ({"max_video_frames": 50}, None, "media_too_large", "more frames than the limit of 50"),
        ({"max_video_frame_pixels": 1000}, None, "media_too_large", "frames of 160x96"),
        ({"max_image_bytes": 1000}, None, "media_too_large", "more than the limit of 1000 bytes"),
    ],
)
def test_limits_refuse_before_decoding(limits, budget, code, message, runner, make_pipeline, image_bytes, video_path):
    pipeline = make_pipeline(**limits)
    image = MediaPart("image", data_url(image_bytes, "image/jpeg"))
    parts = [image, image, MediaPart("video", f"file://{video_path}")]
    with pytest.raises(MediaError, match=message) as error:
        runner.run(pipeline.process_media(parts, vision_token_budget=budget))
    assert error.value.code == code and error.value.status == 400


def test_bfloat16_output_is_the_normalized_reference(image_bytes):
    """The bf16 wire format: normalized like the reference, rounded like torch's bfloat16 cast."""
    preprocessor = load_profile("minimax_m3_vl").preprocessor
    limits = MediaLimits()
    source, output = new_segment_name(), new_segment_name()
    write_segment(source, image_bytes)
    try:
        plan, _ = probe_image_job(source, preprocessor, limits)
        shape = (plan.num_patches, plan.patch_dim)
        process_job(source, preprocessor, plan, None, output, shape, WireDType.BFLOAT16, limits)
        bits = map_segment(output, np.dtype(np.uint16), shape).copy()
    finally:
        unlink_segment(source)
        unlink_segment(output)
    normalized = reference_image_processor()(data_url(image_bytes, "image/jpeg"), return_tensors="pt")["pixel_values"]
    expected = normalized.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, expected)


def test_settings_change_the_content_hash(runner, make_pipeline, image_bytes):
    part = MediaPart("image", data_url(image_bytes, "image/jpeg"))
    (default,) = runner.run(make_pipeline().process_media([part]))
    profile = dataclasses.replace(
        load_profile("minimax_m3_vl"), preprocessor=m3_preprocessor(ResizeBackend.AUTO, image_max_pixels=100_000)
    )
    (smaller,) = runner.run(make_pipeline(profile).process_media([part]))
    assert smaller.content_hash != default.content_hash and smaller.num_tokens < default.num_tokens
