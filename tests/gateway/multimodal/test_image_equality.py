"""Images of many sizes and pixel modes: same grid, tokens and patches as MiniMaxM3VLImageProcessor."""

import functools

import numpy as np
import pytest

from m3stack.gateway.multimodal.image import decode_image, probe_image
from m3stack.gateway.multimodal.resize import ResizeBackend

from .conftest import assert_within_reference_tolerance, data_url, reference_image_processor
from .media_factory import encode_image, natural_rgb

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

TORCHVISION_FORMATS = {"JPEG", "PNG", "WEBP", "GIF"}
MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}

# (height, width, format, mode, EXIF orientation)
CASES = {
    "tiny-1x1": (1, 1, "PNG", None, None),
    "tiny-9x13": (9, 13, "PNG", None, None),
    "small-odd-57x1001": (57, 1001, "PNG", None, None),
    "jpeg-960x1280": (960, 1280, "JPEG", None, None),
    "huge-jpeg-2400x3200": (2400, 3200, "JPEG", None, None),
    "aspect-150-1x150": (1, 150, "PNG", None, None),
    "aspect-200-3x600": (3, 600, "PNG", None, None),
    "tall-7000x40": (7000, 40, "PNG", None, None),
    "rgba-png": (333, 517, "PNG", "RGBA", None),
    "grayscale-png": (300, 200, "PNG", "L", None),
    "grayscale-jpeg": (480, 640, "JPEG", "L", None),
    "palette-png": (250, 410, "PNG", "P", None),
    "palette-gif": (120, 90, "GIF", "P", None),
    "bmp": (64, 96, "BMP", None, None),
    "webp": (200, 300, "WEBP", None, None),
    "exif-rotate-90-jpeg": (300, 500, "JPEG", None, 6),
    "exif-rotate-180-jpeg": (300, 500, "JPEG", None, 3),
    "exif-rotate-270-jpeg": (300, 500, "JPEG", None, 8),
    "exif-mirror-transpose-jpeg": (300, 500, "JPEG", None, 5),
    "exif-mirror-jpeg": (300, 500, "JPEG", None, 2),
    "exif-flip-jpeg": (300, 500, "JPEG", None, 4),
    "exif-transverse-jpeg": (300, 500, "JPEG", None, 7),
    "exif-rotate-90-png": (120, 200, "PNG", None, 6),
    "cmyk-jpeg": (200, 260, "JPEG", "CMYK", None),
}


@pytest.fixture(scope="module")
def reference():
    return reference_image_processor()


def _reference_input(url: str, fmt: str):
    """The URL itself (the reference decodes it), or for formats its decoder lacks, its PIL loader's image."""
    if fmt in TORCHVISION_FORMATS:
        return url
    from transformers.image_utils import load_image

    return load_image(url)


@functools.cache
def _encoded(case: str) -> tuple[bytes, str]:
    height, width, fmt, mode, orientation = CASES[case]
    seed = sum(map(ord, case))  # fresh content per case, reproducible
    data = encode_image(natural_rgb(height, width, seed), fmt, mode, orientation)
    return data, data_url(data, MIME[fmt])


@pytest.mark.parametrize("backend", [ResizeBackend.TORCH, ResizeBackend.PILLOW])
@pytest.mark.parametrize("case", list(CASES))
def test_image_matches_reference(case, backend, m3_profiles, reference):
    data, url = _encoded(case)
    source = _reference_input(url, CASES[case][2])
    profile = m3_profiles[backend]
    header = probe_image(data)
    plan = profile.preprocessor.plan_image(header.height, header.width)
    rgb = decode_image(data, header=header)  # the pipeline's path: JPEGs skip a second header parse
    assert rgb.shape == (header.height, header.width, 3)
    np.testing.assert_array_equal(rgb, decode_image(data))
    ours = np.full((plan.num_patches, plan.patch_dim), 77, dtype=np.uint8)  # poisoned: every byte must be written
    profile.preprocessor.run_image(rgb, plan, ours)

    raw = reference(source, do_rescale=False, do_normalize=False, return_tensors="np")
    assert [list(plan.grids[0])] == raw["image_grid_thw"].tolist()
    assert profile.preprocessor.tokens_for(plan) == int(raw["image_grid_thw"].prod()) // 4
    difference = np.abs(ours.astype(np.int16) - raw["pixel_values"].astype(np.int16))
    if backend is ResizeBackend.TORCH:
        assert difference.max() == 0, "the torch backend runs the reference's own kernel: bit-exact"
    else:
        assert difference.max() <= 2 and difference.mean() < 0.02, (difference.max(), difference.mean())

    normalized = reference(source, return_tensors="np")["pixel_values"]
    assert_within_reference_tolerance(profile.preprocessor.normalize(ours), normalized)
    if backend is ResizeBackend.TORCH:
        np.testing.assert_array_equal(profile.preprocessor.normalize(ours), normalized)


def test_exif_orientation_swaps_the_planned_size():
    data = encode_image(natural_rgb(300, 500, 1), "JPEG", exif_orientation=6)
    header = probe_image(data)
    assert (header.width, header.height) == (300, 500)
    assert decode_image(data).shape == (500, 300, 3)
    assert header.orientation == 6
    np.testing.assert_array_equal(decode_image(data, header=header), decode_image(data))
