"""The ordered registry, checkpoint configs, and a second model (Qwen2-VL) through the same pipeline code."""

import json

import numpy as np
import pytest

from m3stack.gateway.multimodal import m3, qwen2_vl
from m3stack.gateway.multimodal import video as video_codec
from m3stack.gateway.multimodal.registry import ProfileRegistry, load_profile
from m3stack.gateway.multimodal.resize import ResizeBackend

from .conftest import reference_decode_video
from .media_factory import encode_video, natural_rgb


def test_registry_is_keyed_on_model_type_in_order():
    registry = ProfileRegistry()
    registry.register("qwen2_vl", qwen2_vl.profile)
    registry.register("minimax_m3_vl", m3.profile)
    assert registry.model_types() == ["qwen2_vl", "minimax_m3_vl"]
    assert registry.load("minimax_m3_vl").model_type == "minimax_m3_vl"
    with pytest.raises(ValueError, match="already registered"):
        registry.register("qwen2_vl", m3.profile)
    with pytest.raises(KeyError, match="no multimodal profile for model_type 'qwen2_5_vl'"):
        registry.load("qwen2_5_vl")


def test_builtin_profiles_load_by_model_type():
    assert load_profile("minimax_m3_vl").model_type == "minimax_m3_vl"
    assert load_profile("qwen2_vl").prompt.image_token == "<|image_pad|>"


def test_checkpoint_configs_override_the_defaults(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 1000, "longest_edge": 200_000}, "patch_size": 14})
    )
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"fps": 2.0, "max_pixels": 100_000, "vision_segment_max_frames": None})
    )
    constants = m3.constants_from_checkpoint(tmp_path)
    assert (constants.image_min_pixels, constants.image_max_pixels) == (1000, 200_000)
    assert (constants.fps, constants.video_max_pixels, constants.vision_segment_max_frames) == (2.0, 100_000, None)
    assert constants.video_min_pixels == m3.DEFAULTS.video_min_pixels


def test_checkpoint_with_unsupported_resampling_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"resample": 2}))
    with pytest.raises(ValueError, match="only bicubic"):
        m3.constants_from_checkpoint(tmp_path)


@pytest.mark.parametrize("size", [(57, 1001), (480, 640), (20, 30)])
def test_qwen2_vl_image_matches_its_reference(size):
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor

    height, width = size
    rgb = natural_rgb(height, width, seed=height)
    profile = qwen2_vl.profile(resize_backend=ResizeBackend.TORCH)
    plan = profile.preprocessor.plan_image(height, width)
    ours = np.zeros((plan.num_patches, plan.patch_dim), dtype=np.uint8)
    profile.preprocessor.run_image(rgb, plan, ours)
    raw = Qwen2VLImageProcessor()(rgb, do_rescale=False, do_normalize=False, return_tensors="np")
    assert [list(plan.grids[0])] == raw["image_grid_thw"].tolist()
    np.testing.assert_array_equal(ours, raw["pixel_values"])
    assert profile.prompt.image_text(plan, 3) == "<|image_pad|>" * 3


def test_qwen2_vl_video_sampling_and_grid_match_its_reference():
    from transformers.models.qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    data = encode_video(160, 96, 97, 24, seed=9)
    decoded = reference_decode_video(data)
    probe = video_codec.probe_video(data, max_frame_pixels=10**7, max_frames=10**5)
    profile = qwen2_vl.profile(resize_backend=ResizeBackend.TORCH)
    plan = profile.preprocessor.plan_video(probe)
    reference = Qwen2VLVideoProcessor()
    metadata = VideoMetadata(total_num_frames=decoded.total_num_frames, fps=decoded.fps)
    assert list(plan.frame_indices) == reference.sample_frames(metadata, fps=2.0).tolist()
    raw = reference(
        videos=[decoded.frames[list(plan.frame_indices)]],
        do_rescale=False,
        do_normalize=False,
        cap_pixels_per_frame=False,
        return_tensors="np",
    )
    assert [list(g) for g in plan.grids] == raw["video_grid_thw"].tolist()
    frames = video_codec.decode_frames(data, probe, plan.frame_indices)
    ours = np.zeros((plan.num_patches, plan.patch_dim), dtype=np.uint8)
    profile.preprocessor.run_video(frames, plan, ours)
    np.testing.assert_array_equal(ours, raw["pixel_values_videos"])
