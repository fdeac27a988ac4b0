"""config.json reading: the same interpretation as transformers (legacy keys included), clear refusals."""

import copy
import json

import pytest
from transformers import MiniMaxM3VLConfig

from m3stack.engine.model.config import ConfigError, load_config, parse_config

BASE = {
    "model_type": "minimax_m3_vl",
    "image_token_index": 5,
    "video_token_index": 6,
    "projector_hidden_size": 48,
    "text_config": {
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "vision_config": {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64},
}

LEGACY_SPARSE = {
    "use_sparse_attention": True,
    "sparse_attention_freq": [0, 1, 1],
    "sparse_num_index_heads": 2,
    "sparse_index_dim": 16,
    "sparse_block_size": 32,
    "sparse_topk_blocks": 8,
    "sparse_local_block": 2,
    "sparse_init_block": 0,
    "sparse_score_type": "max",
    "sparse_disable_index_value": [0, 1, 1],
}


def _with_text(**changes) -> dict:
    raw = copy.deepcopy(BASE)
    raw["text_config"].update(changes)
    return raw


CASES = {
    "legacy keys (the original MiniMax config)": _with_text(
        sparse_attention_config=LEGACY_SPARSE,
        moe_layer_freq=[0, 1, 1],
        rope_theta=5e6,
        rotary_dim=16,
        partial_rotary_factor=0.5,
    ),
    "flat keys": _with_text(
        layer_types=["full_attention", "minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        index_n_heads=2,
        index_head_dim=64,
        index_block_size=64,
        index_topk_blocks=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    ),
    "legacy index keys override flat ones; explicit layer_types win": _with_text(
        layer_types=["minimax_m3_sparse"] * 3,
        sparse_attention_config=LEGACY_SPARSE,
        index_block_size=128,
        index_n_heads=2,
    ),
    "defaults": _with_text(index_n_heads=2),
}


@pytest.mark.parametrize("raw", CASES.values(), ids=CASES.keys())
def test_reads_config_as_transformers_does(raw):
    ours = parse_config(copy.deepcopy(raw)).text
    hf = MiniMaxM3VLConfig(**copy.deepcopy(raw)).text_config
    assert ours.sparse_layers == tuple(t == "minimax_m3_sparse" for t in hf.layer_types)
    assert ours.moe_layers == tuple(t == "sparse" for t in hf.mlp_layer_types)
    assert (ours.index_num_heads, ours.index_head_dim) == (hf.index_n_heads, hf.index_head_dim)
    assert (ours.index_block_size, ours.index_topk_blocks) == (hf.index_block_size, hf.index_topk_blocks)
    assert ours.index_local_blocks == hf.index_local_blocks
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rotary_dim == int(hf.head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))


REFUSALS = {
    "model_type": ({"model_type": "llama"}, None, "model_type"),
    "quantized": ({"quantization_config": {"quant_method": "fp8"}}, None, "quantization_config"),
    "output gate": (None, {"attention_output_gate": True}, "attention_output_gate"),
    "softmax routing": (None, {"scoring_func": "softmax"}, "scoring_func"),
    "two shared experts": (None, {"n_shared_experts": 2}, "n_shared_experts"),
    "sink blocks": (None, {"sparse_attention_config": {**LEGACY_SPARSE, "sparse_init_block": 1}}, "sparse_init_block"),
    "index values": (
        None,
        {"sparse_attention_config": {**LEGACY_SPARSE, "sparse_disable_index_value": [0, 0, 1]}},
        "sparse_disable_index_value",
    ),
    "rotary_dim disagrees": (None, {"rotary_dim": 16, "partial_rotary_factor": 1.0}, "rotary_dim"),
    "yarn": (None, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    "layer_types length": (None, {"layer_types": ["full_attention"] * 2}, "layer_types"),
    "unknown layer type": (None, {"layer_types": ["sliding_attention"] * 3}, "sliding_attention"),
    "index heads": (None, {"layer_types": ["minimax_m3_sparse"] * 3, "index_n_heads": 4}, "index_n_heads"),
    "GQA": (None, {"num_key_value_heads": 3}, "num_key_value_heads"),
    "token ids": ({"image_token_index": 100}, None, "image_token_index"),
    "type": (None, {"hidden_size": "64"}, "hidden_size"),
}


@pytest.mark.parametrize(("top", "text", "key"), REFUSALS.values(), ids=REFUSALS.keys())
def test_refuses_what_it_cannot_serve_naming_the_key(top, text, key):
    raw = _with_text(**(text or {}))
    raw.update(top or {})
    with pytest.raises(ConfigError, match=key):
        parse_config(raw)


def test_load_config_reads_pixel_normalization_and_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_with_text(index_n_heads=2)))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.25] * 3}))
    config = load_config(tmp_path)
    assert config.image_normalization.mean == (0.5, 0.5, 0.5)
    assert config.video_normalization == config.image_normalization  # no video_preprocessor_config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_config(tmp_path)


def test_original_clip_style_vision_config_is_read():
    raw = _with_text(index_n_heads=2)
    raw["vision_config"] = {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "img_token_compression_config": {"spatial_merge_size": 4, "temporal_patch_size": 1},
    }
    vision = parse_config(raw).vision
    assert (vision.spatial_merge_size, vision.temporal_patch_size) == (4, 1)
