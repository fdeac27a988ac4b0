"""The video limits at their edges: a video exactly at a limit is served, one frame more is refused before any
pixel is decoded, with a message that names the flag moving the limit."""

import asyncio
import io

import av
import pytest

from m3stack.gateway.multimodal import MediaError, MediaLimits, MediaPart, MediaPipeline, load_profile
from m3stack.gateway.multimodal.pipeline import warm_worker
from m3stack.gateway.multimodal.pool import WorkerPool

from .conftest import data_url
from .media_factory import encode_video

FPS = 5
SIDE = 56
# 20 frames at 5 fps: 4 s, 4 frames sampled at the checkpoint's 1 fps; 21 frames: 4.2 s, still 4 sampled;
# 25 frames: 5 s, 5 sampled.
FRAME_COUNTS = (20, 21, 25)


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
def videos() -> dict[int, str]:
    return {count: data_url(encode_video(SIDE, SIDE, count, FPS, seed=count), "video/mp4") for count in FRAME_COUNTS}


# (limit, its value, frames of the video at the limit, frames of the video one step over, what the refusal says)
EDGES = [
    ("max_video_frames", 20, 20, 21, "the video has more frames than the limit of 20 (--media-max-video-frames)"),
    (
        "max_video_seconds",
        4.0,
        20,
        21,
        "lasts 4.2 s (21 frames at 5 fps), longer than the limit of 4 seconds (--media-max-video-seconds)",
    ),
    ("max_sampled_frames", 4, 21, 25, "sampling would take 5 frames, over the limit of 4 (--media-max-sampled-frames)"),
    (
        "max_video_pixels",
        4 * SIDE * SIDE,
        21,
        25,
        "5 sampled frames of 56x56 exceed the limit of 12544 pixels (--media-max-video-pixels)",
    ),
]


@pytest.mark.parametrize(("name", "value", "at_limit", "over", "message"), EDGES, ids=[edge[0] for edge in EDGES])
def test_a_video_at_the_limit_is_served_and_one_step_over_is_refused(
    runner, pool, videos, name, value, at_limit, over, message
):
    pipeline = MediaPipeline(load_profile("minimax_m3_vl"), MediaLimits(**{name: value}), pool=pool)
    try:
        (item,) = runner.run(pipeline.process_media([MediaPart("video", videos[at_limit], param="p")]))
        assert item.num_tokens > 0
        with pytest.raises(MediaError) as refused:
            runner.run(pipeline.process_media([MediaPart("video", videos[over], param="p")]))
    finally:
        runner.run(pipeline.close())
    assert message in refused.value.message
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "media_too_large", "p")


def _keyframes(video: bytes) -> int:
    with av.open(io.BytesIO(video)) as container:
        return sum(packet.is_keyframe for packet in container.demux(video=0) if packet.size)


def test_the_decoded_frames_limit_counts_the_walk_from_each_keyframe(runner, pool):
    """With one keyframe, reaching the sampled frames ``i * total // 4`` walks from frame 0 to the last of them: 16
    frames for 20 frames at 5 fps (0, 5, 10, 15), 17 for 22 (0, 5, 11, 16). With every frame a keyframe the same
    22 frames walk only the 4 sampled ones."""
    one_keyframe = {count: encode_video(SIDE, SIDE, count, FPS, gop=1000, seed=count) for count in (20, 22)}
    every_keyframe = encode_video(SIDE, SIDE, 22, FPS, gop=1, seed=22)
    assert [_keyframes(video) for video in (*one_keyframe.values(), every_keyframe)] == [1, 1, 22]
    pipeline = MediaPipeline(load_profile("minimax_m3_vl"), MediaLimits(max_decoded_frames=16), pool=pool)

    def process(video: bytes) -> int:
        part = MediaPart("video", data_url(video, "video/mp4"), param="messages[0].content[1]")
        (item,) = runner.run(pipeline.process_media([part]))
        return item.num_tokens

    try:
        assert process(one_keyframe[20]) > 0
        assert process(every_keyframe) > 0
        with pytest.raises(MediaError) as refused:
            process(one_keyframe[22])
    finally:
        runner.run(pipeline.close())
    assert refused.value.message.endswith(
        "decoding the sampled frames walks 17 frames, over the limit of 16 (--media-max-decoded-frames)"
    )
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "media_too_large",
        "messages[0].content[1]",
    )
