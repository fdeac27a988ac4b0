"""Image decoding with Pillow: header probe first (no pixels), then a full decode into upright RGB.

The result matches what the reference processor decodes from the same bytes (``load_image_as_tensor``:
libjpeg-turbo/libpng, EXIF orientation applied, alpha dropped, gray and palette expanded to RGB).
"""

import io
import warnings
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import MediaError
from .limits import DEFAULT_IMAGE_FORMATS

EXIF_ORIENTATION = 0x0112
TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}  # the ones that swap width and height
_RGB_CONVERTIBLE = {"RGB", "RGBA", "RGBX", "RGBa", "L", "LA", "La", "P", "PA", "1", "CMYK", "YCbCr"}
_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L"}


@dataclass(frozen=True)
class ImageHeader:
    format: str
    width: int  # upright
    height: int
    mode: str
    orientation: int = 1  # EXIF orientation, 1..8


def probe_image(data: bytes, formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS) -> ImageHeader:
    """Format and upright size from the header alone."""
    with _open(data, formats) as image:
        width, height = image.size
        orientation = _orientation(image)
        if orientation in TRANSPOSING_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(image.format or "?", width, height, image.mode, orientation)


def decode_image(
    data: bytes, formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS, header: ImageHeader | None = None
) -> np.ndarray:
    """Upright ``[H, W, 3]`` uint8 RGB; callers check the header's size against their limits first.

    ``header``, when given, must be ``probe_image``'s for the same bytes: a JPEG then goes straight to
    libjpeg-turbo, without parsing its markers and EXIF in Pillow a second time (~0.2 ms a 1280x960 photo).
    """
    if header is not None and header.format == "JPEG" and header.mode in ("RGB", "L"):
        return _orient(_decode_jpeg(data), header.orientation)
    with _open(data, formats) as image:
        orientation = _orientation(image)
        if image.format == "JPEG" and image.mode in ("RGB", "L"):
            # libjpeg-turbo straight into numpy: the same pixels as Pillow's decode, without its copies.
            return _orient(_decode_jpeg(data), orientation)
        try:
            image.load()
            upright = ImageOps.exif_transpose(image) if orientation != 1 else image
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError... for bad data
            raise MediaError(f"the {image.format or 'image'} data is corrupt or truncated ({exc})") from None
        return _to_rgb(upright)


def _decode_jpeg(data: bytes) -> np.ndarray:
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
    except (ValueError, RuntimeError) as exc:
        raise MediaError(f"the JPEG data is corrupt or truncated ({exc})") from None


def _orient(rgb: np.ndarray, orientation: int) -> np.ndarray:
    """EXIF orientation 1..8 applied as Pillow's ``exif_transpose`` does (a contiguous copy when it moves pixels)."""
    flips = {
        2: lambda a: a[:, ::-1],
        3: lambda a: a[::-1, ::-1],
        4: lambda a: a[::-1],
        5: lambda a: a.transpose(1, 0, 2),
        6: lambda a: np.rot90(a, -1),
        7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
        8: lambda a: np.rot90(a, 1),
    }
    return np.ascontiguousarray(flips[orientation](rgb)) if orientation in flips else rgb


def _open(data: bytes, formats: tuple[str, ...]) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Size limits are enforced by the pipeline before decoding; Pillow's own bomb warning is noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(formats))
    except UnidentifiedImageError:
        raise MediaError(
            f"the data is not an image in a supported format ({', '.join(formats)})", code="unsupported_media"
        ) from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"the image is too large ({exc})", code="media_too_large") from None
    except Exception as exc:
        raise MediaError(f"the image header cannot be read ({exc})") from None


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(EXIF_ORIENTATION, 1))
    except Exception:  # a malformed EXIF block is ignored, as the reference decoders do
        return 1


def _to_rgb(image: Image.Image) -> np.ndarray:
    if image.mode == "RGB":
        return np.asarray(image)
    if image.mode in _RGB_CONVERTIBLE:
        return np.asarray(image.convert("RGB"))
    if image.mode in _SIXTEEN_BIT:
        gray = (np.asarray(image).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    raise MediaError(f"images in pixel mode {image.mode!r} are not supported", code="unsupported_media")
