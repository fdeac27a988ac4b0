"""Every media limit in one place, with the ``m3stack gateway`` flags that set them.

All of them are checked before the expensive step they protect: bytes while downloading, pixels and
frame counts from headers and the demuxed index, tokens from the plans, before any pixel is decoded.
The pixel caps are MiniMax-M3's serving caps (3584x3584 per image, 301,056,000 per video), which
refuse rather than downscale.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from m3stack import options
from m3stack.options import OptionGroup

from .errors import MediaError

M3_MAX_IMAGE_PIXELS = 3584 * 3584
M3_MAX_VIDEO_PIXELS = 301_056_000

# Defaults of the decoder allowlists below.  They live here rather than in image.py/video.py so that this
# module, which the CLI imports to build its flags, loads neither Pillow, PyAV nor numpy.
DEFAULT_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
DEFAULT_CONTAINERS = ("mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm", "avi", "mpegts", "ogg")
DEFAULT_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg", "theora")


@dataclass(frozen=True)
class MediaLimits:
    # Per request
    max_images: int = 16
    max_videos: int = 2
    # Fetching
    max_image_bytes: int = 32 * 2**20
    max_video_bytes: int = 256 * 2**20
    fetch_timeout_s: float = 20.0  # whole download, connect included
    connect_timeout_s: float = 5.0
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] = ()  # empty: any public host
    allow_private_networks: bool = False  # loopback, RFC 1918, link-local... (tests, local demos)
    local_media_dir: str | None = None  # file:// and bare paths are refused unless under this folder
    # Images
    max_image_pixels: int = M3_MAX_IMAGE_PIXELS  # decoded width * height
    # Videos
    max_video_frame_pixels: int = 4096 * 2304  # one decoded frame
    max_video_frames: int = 108_000  # frames in the container (1 h at 30 fps)
    max_video_seconds: float = 3600.0  # frames in the container / frame rate
    max_decoded_frames: int = 20_000  # frames the sparse decode may walk through
    max_sampled_frames: int = 768  # M3's max_frames
    max_video_pixels: int = M3_MAX_VIDEO_PIXELS  # sampled frames * width * height
    # Processing
    job_timeout_s: float = 60.0  # one item's decode + preprocess in a worker
    decode_threads: int = 1  # per video job; 1 under load, more for lone-request latency
    # Decoders exposed to untrusted bytes: Pillow formats, FFmpeg demuxers and video codecs.
    image_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    video_containers: tuple[str, ...] = DEFAULT_CONTAINERS
    video_codecs: tuple[str, ...] = DEFAULT_CODECS

    def check_counts(self, images: int, videos: int) -> None:
        if images > self.max_images:
            raise MediaError(
                f"{images} images exceed {self.limit('max_images', 'per request')}", "too_many_media_items"
            )
        if videos > self.max_videos:
            raise MediaError(
                f"{videos} videos exceed {self.limit('max_videos', 'per request')}", "too_many_media_items"
            )

    def check_image_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_image_pixels:
            raise MediaError(
                f"a {width}x{height} image exceeds {self.limit('max_image_pixels', 'pixels')}", "media_too_large"
            )

    def check_video_duration(self, frames: int, fps: float, seconds: float) -> None:
        if seconds > self.max_video_seconds:
            raise MediaError(
                f"the video lasts {seconds:g} s ({frames} frames at {fps:g} fps), longer than "
                f"{self.limit('max_video_seconds', 'seconds')}",
                "media_too_large",
            )

    def check_video_plan(self, sampled: int, width: int, height: int, decoded: int) -> None:
        if sampled > self.max_sampled_frames:
            raise MediaError(
                f"sampling would take {sampled} frames, over {self.limit('max_sampled_frames')}", "media_too_large"
            )
        if sampled * width * height > self.max_video_pixels:
            raise MediaError(
                f"{sampled} sampled frames of {width}x{height} exceed {self.limit('max_video_pixels', 'pixels')}",
                "media_too_large",
            )
        if decoded > self.max_decoded_frames:
            raise MediaError(
                f"decoding the sampled frames walks {decoded} frames, over {self.limit('max_decoded_frames')}",
                "media_too_large",
            )

    def limit(self, name: str, unit: str = "") -> str:
        return limit_text(name, getattr(self, name), unit)


def limit_text(name: str, value: float, unit: str = "") -> str:
    """``the limit of <value> [unit] (<flag>)``: a refusal names the flag that moves the limit."""
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"the limit of {shown}{' ' + unit if unit else ''} ({_FLAGS[name][0]})"


def check_vision_tokens(total: int, budget: int | None) -> None:
    """``budget``: what the context leaves for vision tokens (None: unchecked here)."""
    if budget is not None and total > budget:
        raise MediaError(
            f"the media need {total} vision tokens but the context leaves room for {budget}",
            "context_length_exceeded",
        )


def _domain_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip().lower().rstrip(".") for part in text.split(",") if part.strip())


_FLAGS: dict[str, tuple[str, Callable[[str], object], str]] = {
    "max_images": ("--media-max-images", options.non_negative_int, "images allowed per request"),
    "max_videos": ("--media-max-videos", options.non_negative_int, "videos allowed per request"),
    "max_image_bytes": ("--media-max-image-bytes", options.positive_int, "largest image download or data: URL"),
    "max_video_bytes": ("--media-max-video-bytes", options.positive_int, "largest video download or data: URL"),
    "fetch_timeout_s": ("--media-fetch-timeout", options.positive_float, "seconds for one media download"),
    "connect_timeout_s": ("--media-connect-timeout", options.positive_float, "seconds to connect to a media host"),
    "max_redirects": ("--media-max-redirects", options.non_negative_int, "redirects followed per media URL"),
    "allowed_domains": (
        "--media-allowed-domains",
        _domain_list,
        "comma-separated hosts (and their subdomains) media URLs may come from (default: any public host)",
    ),
    "local_media_dir": ("--media-local-dir", str, "folder that file:// media URLs may read from (off when unset)"),
    "max_image_pixels": ("--media-max-image-pixels", options.positive_int, "largest decoded image, width*height"),
    "max_video_frame_pixels": ("--media-max-video-frame-pixels", options.positive_int, "largest video frame"),
    "max_video_frames": ("--media-max-video-frames", options.positive_int, "most frames a video may contain"),
    "max_video_seconds": ("--media-max-video-seconds", options.positive_float, "longest video, in seconds"),
    "max_decoded_frames": ("--media-max-decoded-frames", options.positive_int, "most frames decoded per video"),
    "max_sampled_frames": ("--media-max-sampled-frames", options.positive_int, "most frames sampled per video"),
    "max_video_pixels": ("--media-max-video-pixels", options.positive_int, "sampled frames * width * height"),
    "job_timeout_s": ("--media-job-timeout", options.positive_float, "seconds to decode and preprocess one item"),
    "decode_threads": ("--media-decode-threads", options.positive_int, "decoder threads per video job"),
}


def add_arguments(opts: OptionGroup) -> None:
    """Register the media flags (and their ``M3STACK_GATEWAY_MEDIA_*`` variables) on the gateway's parser."""
    defaults = MediaLimits()
    for name, (flag, kind, help_text) in _FLAGS.items():
        default = getattr(defaults, name)
        # An empty allowlist is shown by the help text, not as "(default: ())"; from_args maps None back.
        opts.add(flag, type=kind, default=None if default == () else default, help=help_text)
    opts.flag("--media-allow-private-networks", help="allow media URLs that resolve to loopback or private addresses")


def from_args(args: argparse.Namespace) -> MediaLimits:
    """The limits the flags of ``add_arguments`` (or their variables) set; an unset flag keeps the default."""
    values = {name: getattr(args, flag.lstrip("-").replace("-", "_")) for name, (flag, _, _) in _FLAGS.items()}
    values = {name: value for name, value in values.items() if value is not None}
    values["allow_private_networks"] = args.media_allow_private_networks
    return MediaLimits(**values)
