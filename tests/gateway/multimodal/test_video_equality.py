"""Videos encoded with PyAV: same sampled frames, grids, tokens and patches as MiniMaxM3VLVideoProcessor."""

import dataclasses
import functools
import io
import os

import av
import numpy as np
import pytest
from av.video.frame import PictureType
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from m3stack.gateway.multimodal import video as video_codec
from m3stack.gateway.multimodal.resize import ResizeBackend

from .conftest import (
    assert_within_reference_tolerance,
    m3_preprocessor,
    reference_decode_video,
    reference_video_processor,
    run_reference_video,
)
from .media_factory import encode_video, natural_rgb

# name: (width, height, frames, fps, codec, container, extra encode options)
CASES = {
    "h264-30fps": (160, 96, 120, 30, "libx264", "mp4", {}),
    "h264-24fps-odd-frames": (150, 100, 77, 24, "libx264", "mp4", {}),
    "h264-60fps-short-gop": (128, 72, 150, 60, "libx264", "mp4", {"gop": 8}),
    "h264-vfr": (160, 96, 90, 30, "libx264", "mp4", {"variable_rate": True}),
    "h264-mpegts": (160, 96, 75, 25, "libx264", "mpegts", {}),
    "h264-rotated-90": (160, 96, 64, 30, "libx264", "mp4", {"rotation": 90}),
    "h264-rotated-270": (96, 160, 64, 30, "libx264", "mp4", {"rotation": 270}),
    "hevc": (160, 96, 60, 30, "libx265", "mp4", {}),
    "mpeg4": (160, 96, 75, 25, "mpeg4", "mp4", {}),
    "vp9-webm": (160, 96, 60, 30, "libvpx-vp9", "webm", {}),
    "av1": (160, 96, 48, 24, "libsvtav1", "mp4", {}),
}


@functools.cache
def _encoded(case: str) -> bytes:
    width, height, frames, fps, codec, container, extra = CASES[case]
    return encode_video(width, height, frames, fps, codec, container=container, seed=len(case), **extra)


@functools.cache
def _reference_frames(case: str):
    return reference_decode_video(_encoded(case))


@pytest.mark.parametrize("backend", [ResizeBackend.TORCH, ResizeBackend.PILLOW])
@pytest.mark.parametrize("case", list(CASES))
def test_video_matches_reference(case, backend):
    data = _encoded(case)
    # 4 frames per second so these short clips sample enough frames to span several vision segments.
    preprocessor = m3_preprocessor(backend, fps=4.0)
    reference = reference_video_processor(fps=4.0)
    decoded = _reference_frames(case)

    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    assert probe.frame_count == len(decoded.frames)
    assert probe.fps == pytest.approx(decoded.fps)
    plan = preprocessor.plan_video(probe)

    raw = run_reference_video(decoded, reference, raw=True)
    assert list(plan.frame_indices) == list(raw["video_metadata"][0].frames_indices)
    assert [list(g) for g in plan.grids] == raw["video_grid_thw"].tolist()
    assert preprocessor.tokens_for(plan) == int(raw["video_grid_thw"].prod(axis=1).sum()) // 4

    frames = video_codec.decode_frames(data, probe, plan.frame_indices)
    np.testing.assert_array_equal(frames, decoded.frames[list(plan.frame_indices)])
    ours = np.full((plan.num_patches, plan.patch_dim), 77, dtype=np.uint8)
    preprocessor.run_video(frames, plan, ours)
    # What a pool worker runs: frames streamed from the decoder, resized and patchified as they arrive.
    streamed = np.full_like(ours, 78)
    preprocessor.run_video(video_codec.iter_frames(data, probe, plan.frame_indices), plan, streamed)
    np.testing.assert_array_equal(streamed, ours)
    difference = np.abs(ours.astype(np.int16) - raw["pixel_values_videos"].astype(np.int16))
    if backend is ResizeBackend.TORCH:
        assert difference.max() == 0
    else:
        assert difference.max() <= 2 and difference.mean() < 0.02, (difference.max(), difference.mean())
    normalized = run_reference_video(decoded, reference, raw=False)["pixel_values_videos"]
    assert_within_reference_tolerance(preprocessor.normalize(ours), normalized)


def test_encoding_av1_leaves_the_scheduling_policy_alone():
    encode_video(64, 48, 4, 24, "libsvtav1")
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_rotation_is_read_from_the_display_matrix():
    probe = video_codec.probe_video(_encoded("h264-rotated-90"), max_frame_pixels=10**7, max_frames=10**5)
    assert (probe.rotation, probe.display_size) == (90, (160, 96))


@pytest.mark.parametrize("case", ["h264-30fps", "h264-rotated-90", "hevc", "vp9-webm", "av1", "mpeg4"])
def test_probe_reads_the_first_frame_by_draining_after_its_packet(case):
    """The probe's first frame comes from one packet plus a drain, not from decoding the frames after it:
    it must be the reference's first frame, with the rotation the packet-by-packet decode sees."""
    data = _encoded(case)
    with video_codec._open(data, video_codec.DEFAULT_CONTAINERS) as container:
        stream = container.streams.video[0]
        drained = video_codec._first_frame(container, stream, drain=True)
        walked = video_codec._first_frame(container, stream, drain=False)
        assert drained is not None and walked is not None
        assert (drained.pts, drained.rotation) == (walked.pts, walked.rotation)
        rotation = video_codec.probe_video(data, 10**7, 10**5).rotation
        upright = video_codec._upright(drained, rotation, VideoReformatter())
        np.testing.assert_array_equal(upright, _reference_frames(case).frames[0])


def test_sparse_decode_seeks_and_walks_fewer_frames():
    """With short GOPs the plan seeks between targets instead of decoding every frame."""
    data = _encoded("h264-60fps-short-gop")
    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    indices = [10, 70, 140]
    segments = video_codec.plan_decode(probe, indices)
    assert len(segments) == 3
    assert video_codec.frames_to_decode(probe, segments) < 30
    full = _reference_frames("h264-60fps-short-gop").frames
    np.testing.assert_array_equal(video_codec.decode_frames(data, probe, indices), full[indices])


def test_streamed_frames_must_match_the_plan():
    data = _encoded("h264-24fps-odd-frames")
    preprocessor = m3_preprocessor(ResizeBackend.TORCH, fps=4.0)
    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    plan = preprocessor.plan_video(probe)
    frames = video_codec.decode_frames(data, probe, plan.frame_indices)
    out = np.empty((plan.num_patches, plan.patch_dim), dtype=np.uint8)
    with pytest.raises(ValueError, match="frames for a plan"):
        preprocessor.run_video(iter(frames[:-1]), plan, out)
    with pytest.raises(ValueError, match="more frames than"):
        preprocessor.run_video(iter(np.concatenate([frames, frames[:1]])), plan, out)


def test_frames_of_another_size_than_probed_are_refused():
    """Frames are resized to the plan made from the probe: a frame of another size must not be resized silently."""
    from m3stack.gateway.multimodal import MediaError

    data = _encoded("h264-30fps")
    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    wrong = dataclasses.replace(probe, width=probe.width + 2)
    with pytest.raises(MediaError, match="decoded video frame is 160x96"):
        list(video_codec.iter_frames(data, wrong, [0, 1]))


def test_decoding_open_skips_the_stream_info_decode():
    """The decode path's open must not decode frames to find stream parameters (the probe already has
    what decoding needs): an H.264 stream then opens without a known pixel format."""
    data = _encoded("h264-30fps")
    with video_codec._open(data, video_codec.DEFAULT_CONTAINERS, skip_probe_decode=True) as container:
        assert container.streams.video[0].codec_context.format is None
    with video_codec._open(data, video_codec.DEFAULT_CONTAINERS) as container:
        assert container.streams.video[0].codec_context.format.name == "yuv420p"


@pytest.mark.parametrize(
    ("case", "decoded_at_open"), [("h264-30fps", False), ("vp9-webm", True), ("h264-mpegts", True)]
)
def test_the_probe_skips_the_stream_info_decode_of_mp4_only(case, decoded_at_open):
    """MP4/MOV headers hold every timestamp and the frame rate: the probe's open decodes nothing there (its
    own first-frame decode validates the stream).  Other demuxers open as the reference's loader does."""
    with video_codec._open_for_probe(_encoded(case), video_codec.DEFAULT_CONTAINERS) as container:
        assert (container.streams.video[0].codec_context.format is not None) == decoded_at_open


def test_containers_and_codecs_outside_the_allowlists_are_refused():
    from m3stack.gateway.multimodal import MediaError

    with pytest.raises(MediaError, match="codec 'vp9' is not supported"):
        video_codec.probe_video(_encoded("vp9-webm"), 10**7, 10**5, codecs=("h264",))
    with pytest.raises(MediaError, match="not a video in a supported container"):
        video_codec.probe_video(_encoded("h264-30fps"), 10**7, 10**5, containers=("matroska",))


@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_decode_of_a_b_pyramid_equals_a_full_decode(threads):
    """x264's B-pyramid (B-frames that other frames reference, B-frames that none do): the frames the
    sparse decode hands out, targets of every picture type, equal a plain decode of every frame, while the
    decoder reconstructs fewer frames than it is fed (the non-reference ones that are not targets are dropped)."""
    data = encode_video(320, 180, 120, 30, seed=3)
    with av.open(io.BytesIO(data)) as container:
        decoded = list(container.decode(video=0))
    with av.open(io.BytesIO(data)) as container:
        container.streams.video[0].codec_context.skip_frame = "NONREF"
        references = {frame.pts for frame in container.decode(video=0)}
    full = np.stack([frame.to_ndarray(format="rgb24") for frame in decoded])
    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    indices = list(range(3, 120, 7))
    kinds = {(decoded[i].pict_type, decoded[i].pts in references) for i in indices}
    assert kinds >= {(PictureType.P, True), (PictureType.B, True), (PictureType.B, False)}, kinds
    stats = video_codec.DecodeStats()
    frames = list(video_codec.iter_frames(data, probe, indices, threads=threads, stats=stats))
    np.testing.assert_array_equal(np.stack(frames), full[indices])
    # About a third of this clip's frames are non-reference B-frames, a few of them targets.
    assert stats.packets - stats.frames >= 20, stats


@pytest.mark.parametrize(
    "pix_fmt", ["yuv420p", "yuvj420p", "yuv422p", "yuv444p", "nv12", "yuv420p10le", "gray", "gbrp"]
)
def test_the_clip_converter_gives_the_reference_conversion(pix_fmt):
    """One swscale context for a clip, on the calling thread, gives ``to_ndarray(format="rgb24")``'s pixels
    (which let swscale cut the frame into slices for several threads), also after converting other frames."""
    reformatter = VideoReformatter()
    for seed, (width, height) in enumerate([(1280, 720), (642, 362)]):
        frame = av.VideoFrame.from_ndarray(natural_rgb(height, width, seed), format="rgb24").reformat(format=pix_fmt)
        for colorspace, color_range in [(None, None), (Colorspace.ITU709, ColorRange.JPEG)]:
            if colorspace:
                frame.colorspace, frame.color_range = colorspace, color_range
            ours = video_codec._upright(frame, 0, reformatter)
            np.testing.assert_array_equal(ours, frame.to_ndarray(format="rgb24"))
