"""A checkpoint's ``quantization_config``: which weight format it declares and which modules it leaves alone.

The one format served is MXFP8 as MiniMax ships MiniMax-M3-MXFP8 (read from public sources, see docs/mxfp8.md):

    "quantization_config": {"quant_method": "mxfp8", "activation_scheme": "dynamic",
                            "weight_block_size": [1, 32], "ignored_layers": ["lm_head", "model.embed_tokens", ...]}

Each quantized linear ``X.weight`` ``[out, in]`` is stored as ``float8_e4m3fn`` beside ``X.weight_scale_inv``
``[out, in / 32]`` ``uint8``: an E8M0 exponent per block of 32 input elements, the weight being
``fp8 * 2 ** (byte - 127)``.  ``ignored_layers`` (transformers also reads it as ``modules_to_not_convert``) names
modules kept in full precision, matched on whole dotted segments of the checkpoint names (``lm_head`` matches
``language_model.lm_head.weight``).  Which tensors are FP8 is read from the checkpoint's headers and checked
against this list by the loader (``loader.scan_checkpoint``), never assumed.

The serving math is weight-only: activations stay in the model dtype (bf16 on the GPU), whatever
``activation_scheme`` says, because Hopper has no microscaled tensor cores (``mxfp8_kernels``).

Torch-free: ``config.parse_config`` calls it, and the gateway reads configs without torch.
"""

from dataclasses import dataclass
from typing import Any

MXFP8 = "mxfp8"
SUPPORTED_METHODS = (MXFP8,)
BLOCK_SIZE = 32  # input elements per E8M0 scale
E8M0_BIAS = 127  # a scale byte v means 2 ** (v - 127)
SCALE_SUFFIX = "_scale_inv"  # the scale of checkpoint tensor ``X.weight`` is ``X.weight_scale_inv``
SAFETENSORS_FP8 = "F8_E4M3"
SAFETENSORS_SCALE = "U8"


class QuantizationError(ValueError):
    """A ``quantization_config`` this engine cannot serve."""


@dataclass(frozen=True)
class Mxfp8Config:
    """What ``quantization_config`` says about an MXFP8 checkpoint."""

    ignored_layers: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    def ignores(self, tensor_name: str) -> bool:
        """Whether ``ignored_layers`` keeps the module owning ``tensor_name`` in full precision."""
        return is_ignored(tensor_name, self.ignored_layers)

    def to_json(self) -> dict[str, Any]:
        """The ``quantization_config`` block a writer puts into config.json (the release's keys)."""
        return {
            "quant_method": MXFP8,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": [1, BLOCK_SIZE],
            "ignored_layers": list(self.ignored_layers),
        }


def parse_quantization_config(raw: Any) -> Mxfp8Config | None:
    """``config.json``'s ``quantization_config`` -> the format, None when absent; a ``QuantizationError`` naming
    the method (and what is supported) for anything but MXFP8 with 1x32 blocks."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QuantizationError(f"quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise QuantizationError(
            f"quantization_config.quant_method={method!r} is not supported; this engine serves unquantized "
            f"checkpoints (bf16/fp16/fp32) and {', '.join(SUPPORTED_METHODS)} (FP8 e4m3 weights with one E8M0 "
            f"scale per {BLOCK_SIZE} inputs, as MiniMax-M3-MXFP8)"
        )
    block = raw.get("weight_block_size", [1, BLOCK_SIZE])
    if list(block) != [1, BLOCK_SIZE]:
        raise QuantizationError(f"quantization_config.weight_block_size={block!r}: mxfp8 uses [1, {BLOCK_SIZE}]")
    scale_format = raw.get("scale_fmt", "ue8m0")
    if scale_format != "ue8m0":
        raise QuantizationError(f"quantization_config.scale_fmt={scale_format!r}: mxfp8 scales are ue8m0")
    element_format = raw.get("fmt", "e4m3")
    if element_format != "e4m3":
        raise QuantizationError(f"quantization_config.fmt={element_format!r}: mxfp8 weights are e4m3")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        # A static scheme ships calibrated input scales that a weight-only engine would silently drop.
        raise QuantizationError(f"quantization_config.activation_scheme={scheme!r}: only 'dynamic' is supported")
    ignored = raw.get("ignored_layers", raw.get("modules_to_not_convert")) or []
    if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
        raise QuantizationError(f"quantization_config.ignored_layers must be a list of module names, got {ignored!r}")
    return Mxfp8Config(ignored_layers=tuple(ignored), activation_scheme=scheme)


def is_ignored(tensor_name: str, ignored_layers: tuple[str, ...] | list[str]) -> bool:
    """Whether a module of ``ignored_layers`` owns ``tensor_name``: a run of whole dotted segments."""
    dotted = f".{tensor_name}."
    return any(f".{module.strip('.')}." in dotted for module in ignored_layers if module.strip("."))


def scale_name(weight_name: str) -> str:
    """The checkpoint name of a quantized weight's scale tensor."""
    return weight_name + SCALE_SUFFIX


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[..., in]`` -> ``[..., in / 32]``; the input width must be a whole number of blocks."""
    if not weight_shape or weight_shape[-1] % BLOCK_SIZE:
        raise QuantizationError(f"a weight of shape {list(weight_shape)} has no whole {BLOCK_SIZE}-element blocks")
    return (*weight_shape[:-1], weight_shape[-1] // BLOCK_SIZE)
