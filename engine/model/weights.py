"""Checkpoint tensor names and where each one lands in the serving model.

Checkpoints use MiniMax's original weight names, which is what ``transformers``' ``save_pretrained`` writes for
``minimax_m3_vl`` (its conversion mapping renames them on load), e.g.
``language_model.model.layers.N.block_sparse_moe.experts.E.w1.weight``.  The serving model fuses what runs
together (q/k/v/index-q/index-k in one projection, gate|up of each MLP, all experts of a layer in one tensor),
so one checkpoint tensor fills a slice of one parameter: ``CheckpointTensor.index``.

This table is the one place that knows the layout: the loader validates and copies by it, the tiny
default checkpoint is generated from it, and ``quantizable`` says which parameters may hold MXFP8 weights (every
linear of the decoder's attention, MLPs and experts; never embeddings, the LM head, routers, norms or the vision
side, which serve in full precision).
"""

import re
from dataclasses import dataclass

from m3stack.engine.model.config import M3Config

LANGUAGE_PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
VISION_PREFIX = "vision_tower.vision_model."
# Tensors a checkpoint may carry that serving does not use (multi-token-prediction heads): transformers' rule.
IGNORED = re.compile(r"(^|\.)mtp\.")
# Serving-model parameters that can hold MXFP8 weights (``mxfp8.quantize_parameters``).
QUANTIZABLE = re.compile(
    r"layers\.\d+\.(attn\.(in_proj|o_proj)\.weight|mlp\.(shared_expert\.)?(gate_up_proj|down_proj)(\.weight)?)"
)


@dataclass(frozen=True)
class CheckpointTensor:
    name: str  # the tensor's name in the safetensors files
    shape: tuple[int, ...]  # its shape there
    param: str  # dotted path of the serving model's parameter it fills
    index: tuple[int | slice, ...] = ()  # which part of that parameter (empty: all of it)


def quantizable(param: str) -> bool:
    return QUANTIZABLE.fullmatch(param) is not None


def checkpoint_tensors(config: M3Config) -> list[CheckpointTensor]:
    """Every tensor a checkpoint for ``config`` holds, in a stable order."""
    tensors = _language_tensors(config)
    tensors += _vision_tensors(config)
    tensors += _projector_tensors(config)
    return tensors


def _language_tensors(config: M3Config) -> list[CheckpointTensor]:
    text = config.text
    hidden, vocab = text.hidden_size, text.vocab_size
    out = [CheckpointTensor(f"{LANGUAGE_PREFIX}embed_tokens.weight", (vocab, hidden), "embed_tokens.weight")]
    if not text.tie_word_embeddings:
        out.append(CheckpointTensor(LM_HEAD, (vocab, hidden), "lm_head.weight"))
    out.append(CheckpointTensor(f"{LANGUAGE_PREFIX}norm.weight", (hidden,), "norm.weight"))
    for layer in range(text.num_layers):
        src, dst = f"{LANGUAGE_PREFIX}layers.{layer}.", f"layers.{layer}."
        out += [
            CheckpointTensor(f"{src}input_layernorm.weight", (hidden,), f"{dst}input_norm.weight"),
            CheckpointTensor(f"{src}post_attention_layernorm.weight", (hidden,), f"{dst}post_attention_norm.weight"),
        ]
        out += _attention_tensors(config, layer, f"{src}self_attn.", f"{dst}attn.")
        if text.moe_layers[layer]:
            out += _moe_tensors(config, f"{src}block_sparse_moe.", f"{dst}mlp.")
        else:
            out += _mlp_tensors(f"{src}mlp.", f"{dst}mlp.", hidden, text.dense_intermediate_size)
    return out


def _attention_tensors(config: M3Config, layer: int, src: str, dst: str) -> list[CheckpointTensor]:
    text = config.text
    hidden, head_dim = text.hidden_size, text.head_dim
    rows = [("q_proj", text.num_heads * head_dim), ("k_proj", text.num_kv_heads * head_dim)]
    rows.append(("v_proj", text.num_kv_heads * head_dim))
    norms = [("q_norm", head_dim), ("k_norm", head_dim)]
    if text.sparse_layers[layer]:
        rows += [("index_q_proj", text.index_num_heads * text.index_head_dim), ("index_k_proj", text.index_head_dim)]
        norms += [("index_q_norm", text.index_head_dim), ("index_k_norm", text.index_head_dim)]
    out = []
    start = 0
    for name, size in rows:
        out.append(
            CheckpointTensor(
                f"{src}{name}.weight", (size, hidden), f"{dst}in_proj.weight", (slice(start, start + size),)
            )
        )
        start += size
    out += [CheckpointTensor(f"{src}{name}.weight", (size,), f"{dst}{name}.weight") for name, size in norms]
    out.append(CheckpointTensor(f"{src}o_proj.weight", (hidden, text.num_heads * head_dim), f"{dst}o_proj.weight"))
    return out


def _mlp_tensors(src: str, dst: str, hidden: int, inter: int) -> list[CheckpointTensor]:
    """A SwiGLU MLP stored as gate_proj / up_proj / down_proj; gate and up share one fused parameter."""
    return [
        CheckpointTensor(f"{src}gate_proj.weight", (inter, hidden), f"{dst}gate_up_proj.weight", (slice(0, inter),)),
        CheckpointTensor(f"{src}up_proj.weight", (inter, hidden), f"{dst}gate_up_proj.weight", (slice(inter, None),)),
        CheckpointTensor(f"{src}down_proj.weight", (hidden, inter), f"{dst}down_proj.weight"),
    ]


def _moe_tensors(config: M3Config, src: str, dst: str) -> list[CheckpointTensor]:
    text = config.text
    hidden, inter, experts = text.hidden_size, text.moe_intermediate_size, text.num_experts
    out = [
        CheckpointTensor(f"{src}gate.weight", (experts, hidden), f"{dst}router.weight"),
        CheckpointTensor(f"{src}e_score_correction_bias", (experts,), f"{dst}router.correction_bias"),
    ]
    for e in range(experts):
        # w1 = gate, w3 = up, w2 = down (Mixtral naming).
        out += [
            CheckpointTensor(
                f"{src}experts.{e}.w1.weight", (inter, hidden), f"{dst}gate_up_proj", (e, slice(0, inter))
            ),
            CheckpointTensor(
                f"{src}experts.{e}.w3.weight", (inter, hidden), f"{dst}gate_up_proj", (e, slice(inter, None))
            ),
            CheckpointTensor(f"{src}experts.{e}.w2.weight", (hidden, inter), f"{dst}down_proj", (e,)),
        ]
    out += _mlp_tensors(f"{src}shared_experts.", f"{dst}shared_expert.", hidden, text.shared_intermediate_size)
    return out


def _vision_tensors(config: M3Config) -> list[CheckpointTensor]:
    vision = config.vision
    width = vision.hidden_size
    patch = (vision.num_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
    out = [
        # A Conv3d whose stride equals its kernel is a linear map of each flattened patch.
        CheckpointTensor(
            f"{VISION_PREFIX}embeddings.patch_embedding.weight", (width, *patch), "vision.patch_embed.weight"
        ),
        CheckpointTensor(f"{VISION_PREFIX}pre_layrnorm.weight", (width,), "vision.pre_norm.weight"),
        CheckpointTensor(f"{VISION_PREFIX}pre_layrnorm.bias", (width,), "vision.pre_norm.bias"),
    ]
    for layer in range(vision.num_layers):
        src, dst = f"{VISION_PREFIX}encoder.layers.{layer}.", f"vision.layers.{layer}."
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            rows = (slice(i * width, (i + 1) * width),)
            out += [
                CheckpointTensor(f"{src}self_attn.{name}.weight", (width, width), f"{dst}qkv.weight", rows),
                CheckpointTensor(f"{src}self_attn.{name}.bias", (width,), f"{dst}qkv.bias", rows),
            ]
        out += _linear(f"{src}self_attn.out_proj", f"{dst}out_proj", width, width)
        out += _linear(f"{src}mlp.fc1", f"{dst}fc1", width, vision.intermediate_size)
        out += _linear(f"{src}mlp.fc2", f"{dst}fc2", vision.intermediate_size, width)
        for norm in ("layer_norm1", "layer_norm2"):
            out += [
                CheckpointTensor(f"{src}{norm}.weight", (width,), f"{dst}{norm}.weight"),
                CheckpointTensor(f"{src}{norm}.bias", (width,), f"{dst}{norm}.bias"),
            ]
    return out


def _projector_tensors(config: M3Config) -> list[CheckpointTensor]:
    vision_width, text_width = config.vision.hidden_size, config.text.hidden_size
    inner = config.projector_hidden_size
    merged = text_width * config.merge_unit
    return [
        *_linear("multi_modal_projector.linear_1", "projector.linear_1", vision_width, inner),
        *_linear("multi_modal_projector.linear_2", "projector.linear_2", inner, text_width),
        *_linear("patch_merge_mlp.linear_1", "projector.merge_linear_1", merged, inner),
        *_linear("patch_merge_mlp.linear_2", "projector.merge_linear_2", inner, text_width),
    ]


def _linear(src: str, dst: str, fan_in: int, fan_out: int) -> list[CheckpointTensor]:
    return [
        CheckpointTensor(f"{src}.weight", (fan_out, fan_in), f"{dst}.weight"),
        CheckpointTensor(f"{src}.bias", (fan_out,), f"{dst}.bias"),
    ]
