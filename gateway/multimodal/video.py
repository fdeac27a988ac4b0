"""Video probing and sparse decoding with PyAV.

``probe_video`` demuxes the stream once without decoding (every packet's presentation timestamp and
keyframe flag) and decodes the first frame only to validate the stream and read its size and rotation.
Frame i is the i-th frame in presentation order, which is what the reference's decode loop counts,
so sampling by index stays exact under a variable frame rate.

``decode_frames`` then decodes only what the sampled frames need: it seeks to the keyframe before a
target when that skips frames, tells the decoder to drop non-reference frames that are not targets
(they cannot influence any other frame), and stops after the last target.  The sampled frames are
converted to rgb24 by swscale as the reference's ``to_ndarray(format="rgb24")`` does (same settings, one
context for the clip and no scaler threads: the same pixels for less CPU), then rotated upright;
``iter_frames`` hands them over one at a time (views, no copies), ``decode_frames`` stacks them.
"""

import bisect
import io
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from .errors import MediaError
from .limits import DEFAULT_CODECS, DEFAULT_CONTAINERS, limit_text
from .plans import VideoProbe

logger = logging.getLogger(__name__)
MAX_STREAMS = 64  # stream_options entries; streams beyond these probe as usual
HEADER_TIMED_FORMATS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2"})  # av.ContainerFormat.name of such demuxers


@dataclass
class DecodeStats:
    """What a decode cost: packets fed to the decoder and the frames it reconstructed (it drops the
    non-reference frames that are not targets, so these are fewer)."""

    packets: int = 0
    frames: int = 0


@dataclass(frozen=True)
class DecodeSegment:
    """Seek to the keyframe at ``seek_pts``, then decode through the frames at ``target_pts``."""

    seek_pts: int
    target_pts: tuple[int, ...]


def probe_video(
    data: bytes,
    max_frame_pixels: int,
    max_frames: int,
    containers: Sequence[str] = DEFAULT_CONTAINERS,
    codecs: Sequence[str] = DEFAULT_CODECS,
) -> VideoProbe:
    """Metadata of the first video stream; refuses other containers and codecs, oversized frames and too
    many frames before decoding anything but the first frame."""
    with _open_for_probe(data, containers) as container:
        stream = _video_stream(container)
        codec = stream.codec_context.codec.canonical_name
        if codec not in codecs:
            raise MediaError(f"video codec {codec!r} is not supported ({', '.join(codecs)})", "unsupported_media")
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, max_frame_pixels)
        frame_pts, keyframe_pts = _index(container, stream, max_frames)
        first = _first_frame(container, stream, drain=True) or _first_frame(container, stream, drain=False)
        if first is None:
            raise MediaError("the video has no decodable frames")
        # The size the decoder gives (a header's size can differ from the bitstream's when nothing decoded
        # at open; the frames the decode hands out are checked against this).
        _check_frame_size(first.width, first.height, max_frame_pixels)
        fps = _average_fps(stream, len(frame_pts))
        return VideoProbe(
            codec=codec,
            width=first.width,
            height=first.height,
            rotation=round(first.rotation / 90) % 4 * 90,
            fps=fps,
            time_base=stream.time_base or Fraction(1, 1),
            frame_pts=tuple(frame_pts),
            keyframe_pts=tuple(keyframe_pts),
        )


def plan_decode(probe: VideoProbe, indices: Sequence[int]) -> list[DecodeSegment]:
    """Group the sampled frames into runs that share one seek: a target whose keyframe lies beyond
    everything decoded so far starts a new run at that keyframe."""
    segments: list[DecodeSegment] = []
    decoded_until = -1  # position (in frame_pts) of the last frame the current run decodes
    for index in indices:
        pts = probe.frame_pts[index]
        keyframe = _keyframe_at_or_before(probe.keyframe_pts, pts)
        keyframe_position = bisect.bisect_left(probe.frame_pts, keyframe)
        if not segments or keyframe_position > decoded_until:
            segments.append(DecodeSegment(keyframe, (pts,)))
        else:
            last = segments[-1]
            segments[-1] = DecodeSegment(last.seek_pts, (*last.target_pts, pts))
        decoded_until = index
    return segments


def frames_to_decode(probe: VideoProbe, segments: Sequence[DecodeSegment]) -> int:
    """How many frames the plan walks through (the ``max_decoded_frames`` limit applies to this)."""
    total = 0
    for segment in segments:
        start = bisect.bisect_left(probe.frame_pts, segment.seek_pts)
        end = bisect.bisect_left(probe.frame_pts, segment.target_pts[-1])
        total += end - start + 1
    return total


def decode_frames(
    data: bytes,
    probe: VideoProbe,
    indices: Sequence[int],
    threads: int = 1,
    containers: Sequence[str] = DEFAULT_CONTAINERS,
) -> np.ndarray:
    """The frames at ``indices`` (ascending) as upright ``[T, H, W, 3]`` uint8 RGB."""
    height, width = probe.display_size
    out = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    for slot, frame in zip(out, iter_frames(data, probe, indices, threads, containers), strict=True):
        slot[...] = frame
    return out


def iter_frames(
    data: bytes,
    probe: VideoProbe,
    indices: Sequence[int],
    threads: int = 1,
    containers: Sequence[str] = DEFAULT_CONTAINERS,
    stats: DecodeStats | None = None,
) -> Iterator[np.ndarray]:
    """The frames at ``indices`` (ascending), in order, each an upright ``[H, W, 3]`` uint8 RGB view of its
    own converted frame (no copy): a consumer that resizes as frames arrive never holds the full-size clip."""
    position = {probe.frame_pts[index]: slot for slot, index in enumerate(indices)}
    if len(position) != len(indices):
        raise MediaError("sampled video frames share a timestamp; the file is corrupt")
    with _open(data, containers, skip_probe_decode=True) as container:
        stream = _video_stream(container)
        stream.codec_context.thread_count = threads
        stream.codec_context.thread_type = "FRAME" if threads > 1 else "SLICE"
        pending = set(position)
        # One converter for the clip: ``to_ndarray(format="rgb24")`` sets up a new swscale context for every
        # frame and lets it start threads (~2.1 ms CPU a 720p frame); the same conversion on one context and
        # the calling thread gives the same pixels in ~0.7 ms.
        reformatter = VideoReformatter()
        for frame in _sparse_frames(container, stream, plan_decode(probe, indices), pending, stats or DecodeStats()):
            # Targets come out in presentation order, which is the order of ``indices``.
            if position[frame.pts] != len(position) - len(pending):
                raise MediaError("the video's frames are not in timestamp order; the file is corrupt")
            pending.discard(frame.pts)
            rgb = _upright(frame, probe.rotation, reformatter)
            if rgb.shape[:2] != probe.display_size:  # consumers plan (and resize) from the probe's size
                raise MediaError(f"a decoded video frame is {rgb.shape[1]}x{rgb.shape[0]}, not the stream's size")
            yield rgb
        if pending:
            raise MediaError(f"{len(pending)} sampled video frame(s) could not be decoded; the file is corrupt")


def _sparse_frames(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    segments: list[DecodeSegment],
    pending: set[int],
    stats: DecodeStats,
) -> Iterator[av.VideoFrame]:
    targets = set(pending)
    context = stream.codec_context
    for segment in segments:
        wanted, unfed = set(segment.target_pts), set(segment.target_pts)
        for packet in _packets_from(container, stream, segment.seek_pts):
            # Non-reference frames that are not sampled are needed by nobody: the decoder drops them.
            context.skip_frame = "DEFAULT" if packet.pts in targets or packet.pts is None else "NONREF"
            decoded = _decode(packet)
            unfed.discard(packet.pts)
            if not unfed and wanted:
                # Every target's packet (and so everything it references) is in the decoder: drain its
                # reordering delay instead of decoding further packets.  The next seek resets it.
                decoded += _drain(context)
            stats.packets += 1
            stats.frames += len(decoded)
            for frame in decoded:
                if frame.pts in wanted:
                    wanted.discard(frame.pts)
                    yield frame
            if not wanted:
                break
    context.skip_frame = "DEFAULT"


def _packets_from(
    container: av.container.InputContainer, stream: av.VideoStream, keyframe_pts: int
) -> Iterator[av.Packet]:
    """The stream's packets from the keyframe at ``keyframe_pts`` on, the decoder flushed.  A seek lands on
    it in MP4 or Matroska; MPEG-TS seeks by decode timestamp and lands past it, so then the packets before
    it are read from the start and passed over (demuxing costs little next to decoding)."""
    container.seek(keyframe_pts, stream=stream, backward=True, any_frame=False)
    packets = container.demux(stream)
    first = next(packets, None)
    if first is not None and first.pts != keyframe_pts:
        container.seek(0, stream=stream, backward=True, any_frame=False)
        packets = container.demux(stream)
        first = next((packet for packet in packets if packet.pts == keyframe_pts), None)
    if first is not None:
        yield first
        yield from packets


def _decode(packet: av.Packet) -> list[av.VideoFrame]:
    try:
        return packet.decode()
    except av.FFmpegError as exc:
        raise MediaError(f"the video stream is corrupt ({exc})") from None


def _drain(context: av.VideoCodecContext) -> list[av.VideoFrame]:
    try:
        return context.decode(None)
    except av.FFmpegError as exc:
        raise MediaError(f"the video stream is corrupt ({exc})") from None


def _upright(frame: av.VideoFrame, rotation: int, reformatter: VideoReformatter) -> np.ndarray:
    """The reference's ``frame.to_ndarray(format="rgb24")``, rotated, converted on ``reformatter`` by the
    calling thread alone (swscale's slice threads do not change the pixels: a test compares both)."""
    rgb = reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
    return np.rot90(rgb, rotation // 90) if rotation else rgb


def _check_frame_size(width: int, height: int, max_frame_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise MediaError("the video stream has no frame size")
    if width * height > max_frame_pixels:
        limit = limit_text("max_video_frame_pixels", max_frame_pixels, "pixels")
        raise MediaError(f"video frames of {width}x{height} exceed {limit}", code="media_too_large")


def _open_for_probe(data: bytes, containers: Sequence[str]) -> av.container.InputContainer:
    """Opened without the stream-info decode where the demuxer reads every packet's timestamp and the
    average frame rate from the file's header (the MP4/MOV sample tables): the probe decodes the first
    frame itself anyway.  Elsewhere opened as the reference does, since a demuxer may estimate the frame
    rate from what ``avformat_find_stream_info`` decodes (MPEG-TS) or from how far it reads."""
    container = _open(data, containers, skip_probe_decode=True)
    streams = container.streams.video
    context = streams[0].codec_context if streams else None
    timed = container.format.name in HEADER_TIMED_FORMATS and streams and streams[0].average_rate
    if timed and context is not None and context.width > 0 and context.height > 0:
        return container
    container.close()
    return _open(data, containers)


def _open(data: bytes, containers: Sequence[str], skip_probe_decode: bool = False) -> av.container.InputContainer:
    # Only the listed demuxers may even probe the data: playlist and concat demuxers open other URLs
    # and files, and every extra demuxer is attack surface.
    options = {"format_whitelist": ",".join(containers)}
    # Opening runs avformat_find_stream_info, which decodes the first frame(s) to learn the pixel format
    # (a 720p H.264 keyframe costs ~20 ms).  Decoding after a probe needs none of that (the decoder finds
    # the format in the bitstream, timing comes from the probe), so its open tells those decoders to
    # discard every frame.  The probe does so only for MP4/MOV (``_open_for_probe``): without decoding,
    # some demuxers (MPEG-TS) read further to estimate the frame rate, which could then differ from the
    # reference's.
    stream_options = [{"skip_frame": "all"}] * MAX_STREAMS if skip_probe_decode else None
    try:
        return av.open(io.BytesIO(data), mode="r", options=options, stream_options=stream_options)
    except av.FFmpegError:
        raise MediaError(
            f"the data is not a video in a supported container ({', '.join(containers)})", code="unsupported_media"
        ) from None


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        raise MediaError("the file has no video stream", code="unsupported_media")
    stream = container.streams.video[0]
    if stream.codec_context is None or stream.codec_context.name is None:
        raise MediaError("the video codec is not supported", code="unsupported_media")
    return stream


def _index(
    container: av.container.InputContainer, stream: av.VideoStream, max_frames: int
) -> tuple[list[int], list[int]]:
    frame_pts: list[int] = []
    keyframe_pts: list[int] = []
    try:
        for packet in container.demux(stream):
            if packet.pts is None:  # the flushing packet at the end, or a stream without timestamps
                if packet.size:
                    raise MediaError("the video has packets without timestamps", code="unsupported_media")
                continue
            frame_pts.append(packet.pts)
            if packet.is_keyframe:
                keyframe_pts.append(packet.pts)
            if len(frame_pts) > max_frames:
                raise MediaError(
                    f"the video has more frames than {limit_text('max_video_frames', max_frames)}",
                    code="media_too_large",
                )
    except av.FFmpegError as exc:
        raise MediaError(f"the video container is corrupt ({exc})") from None
    if not frame_pts or not keyframe_pts:
        raise MediaError("the video has no decodable frames")
    frame_pts.sort()
    keyframe_pts.sort()
    container.seek(0, stream=stream, backward=True, any_frame=False)
    return frame_pts, keyframe_pts


def _first_frame(container: av.container.InputContainer, stream: av.VideoStream, drain: bool) -> av.VideoFrame | None:
    """With ``drain``, the decoder is flushed right after the first packet with data: one that holds frames
    back for reordering then hands the first over without decoding the packets it waits for (two more 720p
    frames at x264's defaults).  None if that packet alone gives no frame; the seek resets the decoder."""
    container.seek(0, stream=stream, backward=True, any_frame=False)
    for packet in container.demux(stream):
        frames = _decode(packet)
        if not frames and drain and packet.size:
            frames = _drain(stream.codec_context)
            return frames[0] if frames else None
        if frames:
            return frames[0]
    return None


def _average_fps(stream: av.VideoStream, frame_count: int) -> float:
    rate = stream.average_rate or stream.guessed_rate
    if rate:
        return float(rate)
    if stream.duration and stream.time_base:
        return frame_count / float(stream.duration * stream.time_base)
    raise MediaError("the video has no frame rate")


def _keyframe_at_or_before(keyframes: Sequence[int], pts: int) -> int:
    position = bisect.bisect_right(keyframes, pts) - 1
    return keyframes[max(position, 0)]
