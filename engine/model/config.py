"""M3 checkpoint configuration: ``config.json`` (``model_type: minimax_m3_vl``) plus the pixel normalization.

``parse_config`` reads the same keys, defaults and legacy spellings as ``transformers``'
``MiniMaxM3VLConfig`` (5.24), so one ``config.json`` means one model in both:

- ``text_config.sparse_attention_config`` (legacy): ``sparse_num_index_heads`` / ``sparse_index_dim`` /
  ``sparse_block_size`` / ``sparse_topk_blocks`` / ``sparse_local_block`` override the flat ``index_*`` keys, and
  ``sparse_attention_freq`` gives ``layer_types`` when that is absent; ``moe_layer_freq`` gives
  ``mlp_layer_types`` the same way.
- RoPE: ``rope_parameters`` (or legacy ``rope_scaling`` / top-level ``rope_theta`` and ``partial_rotary_factor``);
  the rotated width is ``int(head_dim * partial_rotary_factor)``, as in the HF model.  A ``rotary_dim`` key that
  disagrees with it is an error rather than a silent choice between the two.

Everything the serving model does not implement (and the HF model would silently ignore) is refused with a
``ConfigError`` naming the key: quantization methods other than MXFP8, output gates, softmax routing, init (sink)
blocks, ...  ``quantization_config`` is read by ``quantization.parse_quantization_config``.
"""

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3stack.engine.model.quantization import Mxfp8Config, QuantizationError, parse_quantization_config

logger = logging.getLogger(__name__)

MODEL_TYPE = "minimax_m3_vl"
FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"

# OPENAI_CLIP_MEAN / OPENAI_CLIP_STD: M3's processor defaults when preprocessor_config.json does not say.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Defaults of MiniMaxM3VLTextConfig / MiniMaxM3VLVisionConfig for keys a config.json leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 200064,
    "hidden_size": 6144,
    "intermediate_size": 3072,
    "num_hidden_layers": 60,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 200034,
    "eos_token_id": 200020,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 4,
    "num_local_experts": 128,
    "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072,
    "routed_scaling_factor": 2.0,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
    "rope_theta": 5000000.0,
}
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
TOP_DEFAULTS: dict[str, Any] = {
    "image_token_index": 200025,
    "video_token_index": 200026,
    "projector_hidden_size": 6144,
}
# transformers' ACT2FN names the vision MLP may use.
VISION_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu")
LEGACY_INDEX_KEYS = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}


class ConfigError(ValueError):
    """The checkpoint's configuration is malformed or asks for something the serving model does not do."""


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    sparse_layers: tuple[bool, ...]  # True: MSA (minimax_m3_sparse); False: dense causal GQA
    moe_layers: tuple[bool, ...]  # True: routed experts + shared expert; False: dense MLP
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    index_num_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    tie_word_embeddings: bool

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    layer_norm_eps: float
    rope_theta: float
    hidden_act: str  # one of VISION_ACTIVATIONS (transformers' ACT2FN names)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x temporal patch x patch x patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def rotary_axis_dim(self) -> int:
        """Channels rotated per axis (t, h, w) of the 3D RoPE; the head's remaining channels pass through."""
        return 2 * ((self.head_dim // 3) // 2)


@dataclass(frozen=True)
class PixelNormalization:
    """How the HF processor maps uint8 pixels to the floats the vision tower reads: ``(x * rescale - mean) / std``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float


@dataclass(frozen=True)
class M3Config:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    projector_hidden_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    image_normalization: PixelNormalization
    video_normalization: PixelNormalization
    quantization: Mxfp8Config | None = None  # None: every weight in a float dtype

    @property
    def merge_unit(self) -> int:
        """Vision patches fused into one language-model token."""
        return self.vision.spatial_merge_size**2


def load_config(path: str | Path) -> M3Config:
    """Read ``config.json`` (and the optional ``preprocessor_config.json`` / ``video_preprocessor_config.json``)."""
    folder = Path(path)
    raw = _read_json(folder / "config.json", required=True)
    image_processor = _read_json(folder / "preprocessor_config.json", required=False)
    video_processor = _read_json(folder / "video_preprocessor_config.json", required=False)
    try:
        return parse_config(raw, image_processor, video_processor)
    except ConfigError as exc:
        raise ConfigError(f"{folder / 'config.json'}: {exc}") from None


def parse_config(
    raw: dict[str, Any],
    image_processor: dict[str, Any] | None = None,
    video_processor: dict[str, Any] | None = None,
) -> M3Config:
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConfigError(f"model_type is {model_type!r}; this engine serves {MODEL_TYPE!r} checkpoints")
    try:
        quantization = parse_quantization_config(raw.get("quantization_config"))
    except QuantizationError as exc:
        raise ConfigError(str(exc)) from None
    text_raw = raw.get("text_config") or {}
    vision_raw = raw.get("vision_config") or {}
    top = {**TOP_DEFAULTS, **raw}
    text = _parse_text(text_raw, tie_top=bool(raw.get("tie_word_embeddings", False)))
    vision = _parse_vision(vision_raw)
    for key in ("image_token_index", "video_token_index"):
        value = _int(top, key)
        if not 0 <= value < text.vocab_size:
            raise ConfigError(f"{key}={value} is outside the vocabulary (vocab_size={text.vocab_size})")
    eos = text_raw.get("eos_token_id", TEXT_DEFAULTS["eos_token_id"])
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    image_norm = _normalization(image_processor or {}, "preprocessor_config.json", None)
    video_norm = _normalization(video_processor or {}, "video_preprocessor_config.json", image_norm)
    return M3Config(
        text=text,
        vision=vision,
        image_token_id=_int(top, "image_token_index"),
        video_token_id=_int(top, "video_token_index"),
        projector_hidden_size=_positive(top, "projector_hidden_size"),
        bos_token_id=text_raw.get("bos_token_id", TEXT_DEFAULTS["bos_token_id"]),
        eos_token_ids=tuple(int(i) for i in eos_ids),
        image_normalization=image_norm,
        video_normalization=video_norm,
        quantization=quantization,
    )


def _parse_text(raw: dict[str, Any], *, tie_top: bool) -> TextConfig:
    _refuse_unsupported_text(raw)
    legacy = raw.get("sparse_attention_config") or {}
    _refuse_unsupported_sparse(legacy)
    values = {**TEXT_DEFAULTS, **raw}
    for flat, old in LEGACY_INDEX_KEYS.items():
        if old in legacy:
            values[flat] = legacy[old]
    num_layers = _positive(values, "num_hidden_layers")

    layer_types = raw.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in legacy:
        layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in legacy["sparse_attention_freq"]]
    layer_types = layer_types or [FULL_ATTENTION] * num_layers
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None and raw.get("moe_layer_freq") is not None:
        mlp_types = [MOE_MLP if f else DENSE_MLP for f in raw["moe_layer_freq"]]
    mlp_types = mlp_types or [MOE_MLP] * num_layers
    sparse_layers = _per_layer(layer_types, "layer_types", num_layers, {SPARSE_ATTENTION: True, FULL_ATTENTION: False})
    moe_layers = _per_layer(mlp_types, "mlp_layer_types", num_layers, {MOE_MLP: True, DENSE_MLP: False})

    hidden = _positive(values, "hidden_size")
    num_heads = _positive(values, "num_attention_heads")
    num_kv_heads = _positive(values, "num_key_value_heads")
    head_dim = _positive(values, "head_dim") if values.get("head_dim") else hidden // num_heads
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    rope_theta, rotary_dim = _rope(values, raw, head_dim)

    index_heads = _positive(values, "index_n_heads")
    if any(sparse_layers) and index_heads != num_kv_heads:
        raise ConfigError(
            f"index_n_heads={index_heads} must equal num_key_value_heads={num_kv_heads}: "
            "MSA selects blocks per KV group"
        )
    index_head_dim = _positive(values, "index_head_dim")
    if index_head_dim % 2:
        raise ConfigError(f"index_head_dim={index_head_dim} must be even (RoPE rotates channel pairs)")
    if _int(values, "index_local_blocks") < 0 or _int(values, "index_local_blocks") > _int(values, "index_topk_blocks"):
        raise ConfigError("index_local_blocks must be in 0..index_topk_blocks")
    num_experts = _positive(values, "num_local_experts")
    top_k = _positive(values, "num_experts_per_tok")
    if any(moe_layers) and top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_local_experts={num_experts}")
    return TextConfig(
        vocab_size=_positive(values, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        rms_norm_eps=_positive_float(values, "rms_norm_eps"),
        max_position_embeddings=_positive(values, "max_position_embeddings"),
        sparse_layers=sparse_layers,
        moe_layers=moe_layers,
        dense_intermediate_size=_positive(values, "dense_intermediate_size"),
        moe_intermediate_size=_positive(values, "intermediate_size"),
        shared_intermediate_size=_positive(values, "shared_intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        routed_scaling_factor=float(values["routed_scaling_factor"]),
        swiglu_alpha=float(values["swiglu_alpha"]),
        swiglu_limit=_positive_float(values, "swiglu_limit"),
        index_num_heads=index_heads,
        index_head_dim=index_head_dim,
        index_block_size=_positive(values, "index_block_size"),
        index_topk_blocks=_positive(values, "index_topk_blocks"),
        index_local_blocks=_int(values, "index_local_blocks"),
        tie_word_embeddings=tie_top or bool(values["tie_word_embeddings"]),
    )


def _rope(values: dict[str, Any], raw: dict[str, Any], head_dim: int) -> tuple[float, int]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"text rope_type={rope_type!r} is not supported (only 'default')")
    theta = float(params.get("rope_theta", values["rope_theta"]))
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"partial_rotary_factor={factor} gives rotary width {rotary_dim} for head_dim={head_dim}")
    declared = raw.get("rotary_dim")
    if declared is not None and int(declared) != rotary_dim:
        raise ConfigError(
            f"rotary_dim={declared} disagrees with head_dim * partial_rotary_factor = {rotary_dim}; "
            f"set partial_rotary_factor={int(declared) / head_dim} (the value transformers uses)"
        )
    return theta, rotary_dim


def _refuse_unsupported_text(raw: dict[str, Any]) -> None:
    refusals = {
        "attention_output_gate": (bool, "gated attention outputs"),
        "use_gemma_norm": (lambda v: v is False, "non-Gemma (weight without +1) RMSNorm"),
        "use_qk_norm": (lambda v: v is False, "attention without q/k RMSNorm"),
        "qk_norm_type": (lambda v: v != "per_head", "q/k norm other than per_head"),
        "scoring_func": (lambda v: v != "sigmoid", "router scoring other than sigmoid"),
        "use_routing_bias": (lambda v: v is False, "routers without e_score_correction_bias"),
        "n_shared_experts": (lambda v: v != 1, "a shared-expert count other than 1"),
    }
    for key, (is_unsupported, what) in refusals.items():
        if key in raw and is_unsupported(raw[key]):
            raise ConfigError(f"text_config.{key}={raw[key]!r} asks for {what}, which is not supported")


def _refuse_unsupported_sparse(legacy: dict[str, Any]) -> None:
    if legacy.get("sparse_init_block", 0):
        raise ConfigError("sparse_attention_config.sparse_init_block > 0 (forced sink blocks) is not supported")
    if legacy.get("sparse_score_type", "max") != "max":
        raise ConfigError(f"sparse_attention_config.sparse_score_type={legacy['sparse_score_type']!r}: only 'max'")
    freq = legacy.get("sparse_attention_freq") or []
    disabled = legacy.get("sparse_disable_index_value")
    if disabled is not None:
        for layer, (sparse, no_value) in enumerate(zip(freq, disabled, strict=False)):
            if sparse and not no_value:
                raise ConfigError(
                    f"sparse_attention_config.sparse_disable_index_value[{layer}] is 0: "
                    "the index-value branch is not supported"
                )


def _parse_vision(raw: dict[str, Any]) -> VisionConfig:
    # The original MiniMax config nests the merge settings (CLIP-style vision_config).
    legacy = raw.get("img_token_compression_config") or {}
    values = {**VISION_DEFAULTS, **legacy, **raw}
    if values["hidden_act"] not in VISION_ACTIVATIONS:
        raise ConfigError(
            f"vision_config.hidden_act={values['hidden_act']!r} is not supported ({', '.join(VISION_ACTIVATIONS)})"
        )
    params = raw.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type not in ("axial", "default"):
        raise ConfigError(f"vision rope_type={rope_type!r} is not supported (only 'axial')")
    hidden = _positive(values, "hidden_size")
    heads = _positive(values, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"vision_config.hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=_positive(values, "intermediate_size"),
        num_layers=_positive(values, "num_hidden_layers"),
        num_heads=heads,
        num_channels=_positive(values, "num_channels"),
        patch_size=_positive(values, "patch_size"),
        temporal_patch_size=_positive(values, "temporal_patch_size"),
        spatial_merge_size=_positive(values, "spatial_merge_size"),
        layer_norm_eps=_positive_float(values, "layer_norm_eps"),
        rope_theta=float(params.get("rope_theta", values["rope_theta"])),
        hidden_act=values["hidden_act"],
    )


def _normalization(raw: dict[str, Any], name: str, fallback: PixelNormalization | None) -> PixelNormalization:
    if not raw and fallback is not None:
        return fallback
    if raw.get("do_normalize") is False or raw.get("do_rescale") is False:
        raise ConfigError(f"{name}: do_normalize / do_rescale = false is not supported for uint8 patches")
    mean = tuple(float(x) for x in raw.get("image_mean", CLIP_MEAN))
    std = tuple(float(x) for x in raw.get("image_std", CLIP_STD))
    rescale = float(raw.get("rescale_factor", 1 / 255))
    if len(mean) != len(std) or any(s <= 0 for s in std) or not math.isfinite(rescale) or rescale <= 0:
        raise ConfigError(f"{name}: image_mean/image_std/rescale_factor are inconsistent ({mean}, {std}, {rescale})")
    return PixelNormalization(mean=mean, std=std, rescale_factor=rescale)


def _per_layer(types: list[Any], key: str, num_layers: int, meaning: dict[str, bool]) -> tuple[bool, ...]:
    if len(types) != num_layers:
        raise ConfigError(f"{key} has {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted({str(t) for t in types} - set(meaning))
    if unknown:
        raise ConfigError(f"{key} has unsupported entries {unknown}; expected {sorted(meaning)}")
    return tuple(meaning[t] for t in types)


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path} does not exist: expected an HF-layout M3 checkpoint folder")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _int(values: dict[str, Any], key: str) -> int:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value


def _positive(values: dict[str, Any], key: str) -> int:
    value = _int(values, key)
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}")
    return value


def _positive_float(values: dict[str, Any], key: str) -> float:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a number > 0, got {value!r}")
    return float(value)
