"""Write an MXFP8 copy of a float M3 checkpoint in the layout of the MiniMax-M3-MXFP8 release.

Every linear of the decoder's attention (q/k/v/o and the MSA index projections), dense MLPs, shared and routed
experts becomes ``F8_E4M3`` ``X.weight`` plus ``U8`` ``X.weight_scale_inv`` (``mxfp8.quantize``: one E8M0 exponent
per 32 inputs, the smallest power of two that fits the block in e4m3); embeddings, the LM head, routers, norms,
the vision tower and the projector are copied as stored.  config.json gains the release's
``quantization_config`` (``quantization.Mxfp8Config.to_json``); every other file is copied; the shards keep
their names and contents, so ``model.safetensors.index.json`` maps each scale to its weight's shard.

Shards are written one at a time (one shard's tensors in memory).  ``write_dequantized_copy`` writes the float
checkpoint an MXFP8 copy stands for (each weight ``fp8 * 2 ** (scale - 127)``): the reference model of the
equality tests.
"""

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from m3stack.engine.model import mxfp8
from m3stack.engine.model.checkpoint_files import INDEX_FILE, SINGLE_FILE, shard_files
from m3stack.engine.model.config import load_config
from m3stack.engine.model.quantization import SCALE_SUFFIX, Mxfp8Config, scale_name
from m3stack.engine.model.weights import checkpoint_tensors, quantizable

logger = logging.getLogger(__name__)

Converter = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]

# The release's ignored_layers (names in the checkpoint's namespace, matched on whole dotted segments).  Routers,
# norms and the projector are not in it, and not quantized either: only ``weights.quantizable`` tensors are.
RELEASE_IGNORED_LAYERS = ("lm_head", "model.embed_tokens", "vision_tower")


def write_mxfp8_copy(
    source: str | Path, target: str | Path, ignored_layers: tuple[str, ...] = RELEASE_IGNORED_LAYERS
) -> Path:
    """Write the MXFP8 copy of the float checkpoint ``source`` into the new folder ``target``."""
    source, target = Path(source), Path(target)
    config = load_config(source)
    if config.quantization is not None:
        raise ValueError(f"{source} is already quantized ({config.quantization.to_json()['quant_method']})")
    quantization = Mxfp8Config(ignored_layers=tuple(ignored_layers))
    params = {spec.name: spec.param for spec in checkpoint_tensors(config)}

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        param = params.get(name)
        if param is None or not quantizable(param) or quantization.ignores(name):
            return {name: tensor}
        values, scales = mxfp8.quantize(tensor)
        return {name: values, scale_name(name): scales}

    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = quantization.to_json()
    _copy(source, target, raw, convert)
    logger.info("wrote the MXFP8 copy of %s to %s", source, target)
    return target


def write_dequantized_copy(source: str | Path, target: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the float checkpoint the MXFP8 checkpoint ``source`` stands for: every FP8 weight times its scales,
    in ``dtype``, scales dropped, ``quantization_config`` removed; every other tensor as stored."""
    source, target = Path(source), Path(target)
    scales: dict[str, torch.Tensor] = {}
    for shard in shard_files(source):  # a weight's scale may sit in another shard
        with safe_open(str(shard), framework="pt") as reader:
            scales.update({n: reader.get_tensor(n) for n in reader.keys() if n.endswith(SCALE_SUFFIX)})  # noqa: SIM118

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(SCALE_SUFFIX):
            return {}
        if mxfp8.is_quantized(tensor):
            return {name: mxfp8.dequantize(tensor, scales[scale_name(name)], dtype)}
        return {name: tensor}

    raw = json.loads((source / "config.json").read_text())
    if raw.pop("quantization_config", None) is None:
        raise ValueError(f"{source} has no quantization_config")
    _copy(source, target, raw, convert)
    return target


def _copy(source: Path, target: Path, config: dict[str, Any], convert: Converter) -> None:
    """Copy ``source`` to the new folder ``target`` with ``config`` as config.json and each tensor through
    ``convert`` (name, tensor -> the tensors to write in its place)."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} exists and is not an empty folder")
    target.mkdir(parents=True, exist_ok=True)
    shards = shard_files(source)
    for path in source.iterdir():
        if path.is_file() and path.name not in ("config.json", INDEX_FILE) and path not in shards:
            shutil.copy2(path, target / path.name)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as reader:
            out: dict[str, torch.Tensor] = {}
            for name in reader.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
                out.update(convert(name, reader.get_tensor(name)))
        save_file(out, str(target / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
        logger.info("wrote %s (%d tensors)", shard.name, len(out))
    if shards != [source / SINGLE_FILE]:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
