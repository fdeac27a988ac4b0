"""Vision input: uint8 patch normalization vs the HF processor, tower + projector vs transformers, bad input."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.model.config import VISION_ACTIVATIONS
from m3stack.engine.model.loader import load_model
from m3stack.engine.model.vision import Modality, normalize_patches
from tests.engine.model.hf_oracle import relative_error


@pytest.fixture(scope="module")
def ours(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for size in [(60, 100, 3), (140, 84, 3)]]


def test_uint8_patches_normalize_like_the_processor(ours, processor, images):
    video = np.random.default_rng(8).integers(0, 256, (5, 56, 56, 3), dtype=np.uint8)
    for pixels, raw, norm in [
        (
            processor.image_processor(images=images, return_tensors="pt")["pixel_values"],
            processor.image_processor(images=images, do_rescale=False, do_normalize=False, return_tensors="pt"),
            ours.config.image_normalization,
        ),
        (
            processor.video_processor(videos=[video], return_tensors="pt")["pixel_values_videos"],
            processor.video_processor(videos=[video], do_rescale=False, do_normalize=False, return_tensors="pt"),
            ours.config.video_normalization,
        ),
    ]:
        patches = raw.get("pixel_values", raw.get("pixel_values_videos"))
        assert patches.dtype == torch.uint8
        torch.testing.assert_close(normalize_patches(patches, norm), pixels, rtol=0, atol=1e-5)


def test_several_images_in_one_call_match_transformers(ours, oracle, processor, images):
    inputs = processor.image_processor(images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    with torch.inference_mode():
        embeds = ours.encode_vision(inputs["pixel_values"], grid, Modality.IMAGE)
        reference = torch.cat(oracle.get_image_features(inputs["pixel_values"], grid).pooler_output)
    assert embeds.shape == (int(grid.prod(-1).sum()) // 4, ours.config.text.hidden_size)
    assert relative_error(embeds, reference) <= 1e-5


@pytest.mark.parametrize(
    ("rows", "grid", "dtype", "message"),
    [
        (16, [[1, 4, 4]], torch.int32, "uint8 or floating point"),
        (16, [[1, 4, 5]], torch.float32, "multiples of 2"),
        (16, [[1, 4, 2]], torch.float32, "describes 8 patches but pixel_values has 16 rows"),
        (16, [[0, 4, 4]], torch.float32, "positive sizes"),
        (16, [4, 4], torch.float32, r"shape \[n, 3\]"),
    ],
)
def test_bad_vision_input_is_a_clear_error(ours, rows, grid, dtype, message):
    pixels = torch.zeros((rows, ours.config.vision.patch_dim), dtype=dtype)
    with pytest.raises(ValueError, match=message):
        ours.encode_vision(pixels, torch.tensor(grid), Modality.IMAGE)


def test_wrong_patch_length_is_a_clear_error(ours):
    with pytest.raises(ValueError, match=f"pixel_values must be \\[N, {ours.config.vision.patch_dim}\\]"):
        ours.encode_vision(torch.zeros((4, 10)), torch.tensor([[1, 2, 2]]), Modality.IMAGE)


def test_unknown_modality_is_a_clear_error(ours):
    with pytest.raises(ValueError, match="'audio' is not a valid Modality"):
        ours.encode_vision(torch.zeros((4, ours.config.vision.patch_dim)), torch.tensor([[1, 2, 2]]), "audio")


@pytest.mark.parametrize("activation", VISION_ACTIVATIONS)
def test_vision_activations_match_transformers(tiny_model_dir, tmp_path, activation):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["hidden_act"] = activation
    (folder / "config.json").write_text(json.dumps(config))
    ours = load_model(folder)[0]
    oracle = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    grid = torch.tensor([[2, 4, 6]])
    patches = torch.randn((48, ours.config.vision.patch_dim), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        embeds = ours.encode_vision(patches, grid, Modality.VIDEO)
        reference = torch.cat(oracle.get_video_features(patches, grid).pooler_output)
    assert relative_error(embeds, reference) <= 1e-5
