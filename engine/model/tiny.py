"""The embedded default model: a tiny M3 checkpoint with RANDOM weights, in the layout ``save_pretrained`` writes.

It has every part of the real architecture at toy sizes: a dense-attention + dense-MLP first layer, then MSA
layers with MoE (4 experts, top-2, shared expert), partial RoPE, a 2-layer vision tower with 3D RoPE and the
projector; MSA blocks of 16 tokens with top-4 selection, so selection is really sparse past 64 tokens.  Its
answers are random tokens: it exists so the whole stack runs anywhere, on CPU, in seconds.

Generation is seeded, so every machine builds the same files.  ``ensure_tiny_checkpoint()`` creates it once in
``$M3STACK_CACHE/models/tiny-<TINY_VERSION>`` (default ``~/.cache/m3stack``); concurrent callers (pytest-xdist
workers, several engines) wait on a file lock and share one copy.  Bump ``TINY_VERSION`` (in
``m3stack.default_model``, which finds the folder without the engine) whenever the output changes.  The container
images generate it at build time under their ``M3STACK_CACHE`` (/opt/m3stack/cache), the gateway's without the
weights (torch is only needed for those), so ``--model default`` names the same files in every pod.
"""

import fcntl
import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3stack.default_model import tiny_checkpoint_dir
from m3stack.engine.model.config import CLIP_MEAN, CLIP_STD, parse_config
from m3stack.engine.model.tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    build_tiny_tokenizer,
    chat_template,
)
from m3stack.engine.model.weights import CheckpointTensor, checkpoint_tensors

if TYPE_CHECKING:  # torch is imported where the weights are made: the rest serves the gateway, which has none
    import torch

logger = logging.getLogger(__name__)

SEED = 20261130
NUM_SHARDS = 2  # more than one, so the default model exercises the sharded (index json) loading path
WEIGHT_INDEX = "model.safetensors.index.json"
# Gate/up projections get a larger scale so that some pre-activations pass swiglu_limit and the clamp matters.
GATE_UP_GAIN = 3.0

PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2


def tiny_config(vocab_size: int, bos_id: int, eos_id: int, image_id: int, video_id: int) -> dict[str, Any]:
    """``config.json`` of the tiny model, spelled as ``transformers`` writes it."""
    layer_types = ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "minimax_m3_sparse"]
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "dtype": "float32",
        "image_token_index": image_id,
        "video_token_index": video_id,
        "projector_hidden_size": 96,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "minimax_m3_vl_text",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "num_hidden_layers": len(layer_types),
            "layer_types": layer_types,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rotary_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 65536,
            "dense_intermediate_size": 128,
            "intermediate_size": 32,
            "shared_intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "routed_scaling_factor": 2.0,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "index_n_heads": 2,
            "index_head_dim": 32,
            "index_block_size": 16,
            "index_topk_blocks": 4,
            "index_local_blocks": 1,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "minimax_m3_vl_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_channels": 3,
            "patch_size": PATCH_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
    }


def _pixel_settings() -> dict[str, Any]:
    """What M3's image and video processors share: bicubic resize, CLIP normalization, 14px patches, 2x2 merge."""
    return {
        "processor_class": "MiniMaxM3VLProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "do_convert_rgb": True,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def image_processor_config() -> dict[str, Any]:
    """M3's image processor settings (``MiniMaxM3VLImageProcessor`` defaults)."""
    return {
        **_pixel_settings(),
        "image_processor_type": "MiniMaxM3VLImageProcessor",
        "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 451584},
    }


def video_processor_config() -> dict[str, Any]:
    """M3's video processor settings (``MiniMaxM3VLVideoProcessor`` defaults)."""
    return {
        **_pixel_settings(),
        "video_processor_type": "MiniMaxM3VLVideoProcessor",
        "size": {"height": 672, "width": 672},
        "do_sample_frames": False,
        "min_pixels": 4 * 28 * 28,
        "max_pixels": 768 * 28 * 28,
        "total_pixels": int(64000 * 28 * 28 * 0.9),
        "fps": 1.0,
        "min_frames": 4,
        "max_frames": 768,
        "vision_segment_max_frames": 4,
    }


def write_tiny_checkpoint(
    folder: str | Path, text_overrides: dict[str, Any] | None = None, *, weights: bool = True
) -> Path:
    """Write the tiny checkpoint (weights, configs, tokenizer, chat template) into ``folder``.

    ``text_overrides`` change its text config (tests of other layouts, e.g. more KV heads to split 4 ways).
    ``weights=False`` writes every other file, the same bytes, without torch: what a gateway reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in (BOS_TOKEN, EOS_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN)}
    raw_config = tiny_config(
        tokenizer.get_vocab_size(), ids[BOS_TOKEN], ids[EOS_TOKEN], ids[IMAGE_TOKEN], ids[VIDEO_TOKEN]
    )
    raw_config["text_config"].update(text_overrides or {})
    config = parse_config(raw_config)
    _write_json(folder / "config.json", raw_config)
    _write_json(folder / "generation_config.json", {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN]})
    _write_json(folder / "preprocessor_config.json", image_processor_config())
    _write_json(folder / "video_preprocessor_config.json", video_processor_config())
    _write_json(folder / "processor_config.json", {"processor_class": "MiniMaxM3VLProcessor"})
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "processor_class": "MiniMaxM3VLProcessor",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config.text.max_position_embeddings,
        },
    )
    (folder / "chat_template.jinja").write_text(chat_template())
    if weights:
        _write_weights(folder, checkpoint_tensors(config))
    (folder / "README.md").write_text(
        "Tiny M3-architecture checkpoint with RANDOM weights, generated by `m3stack model init-tiny`.\n"
        "Its outputs are random tokens; it exists for tests and for running the stack without a real model.\n"
    )
    return folder


def ensure_tiny_checkpoint(cache_root: str | Path | None = None, *, weights: bool = True) -> Path:
    """The cached tiny checkpoint's folder, generated on first use (safe to call from many processes).

    ``weights=False`` fills it without the weights (the gateway image's copy); an engine (``weights=True``)
    finding such a folder stops with an error instead of loading a checkpoint that has no weights."""
    folder = tiny_checkpoint_dir(cache_root)
    if folder.is_dir():
        return _checked(folder, weights)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if folder.is_dir():  # another process finished it while we waited
            return _checked(folder, weights)
        logger.info("generating the tiny default model (random weights) in %s", folder)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            write_tiny_checkpoint(staging, weights=weights)
            # mkdtemp and safetensors make their files private; other users read them too (the images'
            # non-root pods, a cache shared by CI and developers).
            staging.chmod(0o755)
            for path in staging.iterdir():
                path.chmod(0o644)
            # The folder appears complete or not at all.
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _checked(folder: Path, weights: bool) -> Path:
    if weights and not (folder / WEIGHT_INDEX).is_file():
        raise ValueError(
            f"{folder} holds the tiny model without its weights (`m3stack model init-tiny --no-weights`, for a "
            "gateway); remove it and run `m3stack model init-tiny` to create the whole model"
        )
    return folder


def _write_weights(folder: Path, tensors: list[CheckpointTensor]) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(SEED)
    values = {spec.name: _random_tensor(spec, generator) for spec in tensors}
    total = sum(t.numel() * t.element_size() for t in values.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(NUM_SHARDS)]
    written = 0
    for name, value in values.items():
        shards[min(NUM_SHARDS - 1, written * NUM_SHARDS // total)][name] = value
        written += value.numel() * value.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    _write_json(folder / WEIGHT_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _random_tensor(spec: CheckpointTensor, generator: "torch.Generator") -> "torch.Tensor":
    """Scaled so activations stay O(1) through the layers and the random model's logits are not flat."""
    import torch

    noise = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    name = spec.name
    if name.endswith("embed_tokens.weight"):
        return noise
    if name.endswith("e_score_correction_bias"):
        return 0.1 * noise
    if len(spec.shape) == 1:
        if name.startswith("language_model."):
            # Gemma RMSNorm stores weight - 1; random offsets make a forgotten "+ 1" visible.
            return 0.1 * noise
        if "norm" in name and name.endswith(".weight"):
            return 1.0 + 0.1 * noise
        return 0.02 * noise  # biases
    fan_in = math.prod(spec.shape[1:])
    gain = GATE_UP_GAIN if name.endswith(("gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")) else 1.0
    return noise * (gain / fan_in**0.5)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
