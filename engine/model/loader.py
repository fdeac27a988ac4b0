"""Load an HF-layout M3 checkpoint (safetensors, sharded with ``model.safetensors.index.json`` or single-file).

Two passes: ``scan_checkpoint`` reads only the safetensors headers and fails fast, listing every missing,
unexpected or mis-shaped tensor, before any data is read; then ``load_weights`` goes shard by shard and copies
one tensor at a time into the already-allocated parameters (converting dtype, moving to the device), so host
memory never holds more than one tensor and the device never holds two copies.

An MXFP8 checkpoint (``quantization_config``, see ``quantization``) stores some linears as ``F8_E4M3`` with a
``U8`` ``<name>_scale_inv`` beside each.  The scan reads which from the headers and checks them against the
config (``ignored_layers``) and against what the serving model can hold in FP8 (``weights.quantizable``); those
parameters then keep FP8 storage with their scales (``CheckpointScan.quantized``), copied as stored.
"""

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from m3stack.engine.model.checkpoint_files import CheckpointError, read_header, shard_files
from m3stack.engine.model.config import M3Config, load_config
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.model.quantization import (
    BLOCK_SIZE,
    SAFETENSORS_FP8,
    SAFETENSORS_SCALE,
    SCALE_SUFFIX,
    Mxfp8Config,
    scale_name,
    scale_shape,
)
from m3stack.engine.model.weights import IGNORED, CheckpointTensor, checkpoint_tensors, quantizable

logger = logging.getLogger(__name__)

MAX_LISTED = 10  # names quoted per problem kind in an error message
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class CheckpointScan:
    """Which file holds which expected tensor (all present with the right shapes)."""

    files: dict[Path, list[CheckpointTensor]]
    ignored: list[str]
    quantized: frozenset[str] = frozenset()  # serving-model parameters stored in MXFP8 (their scales included)

    @property
    def num_tensors(self) -> int:
        return sum(len(specs) for specs in self.files.values())


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[M3ForServing, M3Config]:
    config = load_config(path)
    scan = scan_checkpoint(path, config)
    model = M3ForServing(config, dtype, device, quantized=scan.quantized)
    load_weights(model, scan)
    return model.eval(), config


def scan_checkpoint(path: str | Path, config: M3Config) -> CheckpointScan:
    """Check every tensor's name, shape and dtype against ``config`` from the file headers alone."""
    folder = Path(path)
    expected = {spec.name: spec for spec in checkpoint_tensors(config)}
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    problems: dict[str, list[str]] = defaultdict(list)
    ignored: list[str] = []
    for file in shard_files(folder):
        for name, shape, dtype in read_header(file):
            if IGNORED.search(name):
                ignored.append(name)
            elif name in found:
                problems["duplicated"].append(f"{name} (in {found[name][0].name} and {file.name})")
            else:
                found[name] = (file, shape, dtype)
    files: dict[Path, list[CheckpointTensor]] = defaultdict(list)
    formats: dict[str, set[str]] = defaultdict(set)  # serving parameter -> the dtypes of the tensors filling it
    scales_used: set[str] = set()
    for name, (file, shape, dtype) in found.items():
        spec = expected.get(name)
        if spec is None:
            if not name.endswith(SCALE_SUFFIX):  # a scale is checked with its weight, below
                problems["unexpected"].append(name)
        elif shape != spec.shape:
            problems["mis-shaped"].append(f"{name} is {list(shape)}, expected {list(spec.shape)}")
        elif dtype == SAFETENSORS_FP8:
            problem = _fp8_problem(spec, found, config.quantization)
            if problem:
                problems["FP8"].append(problem)
                continue
            scale = scale_name(name)
            files[file].append(spec)
            files[found[scale][0]].append(
                CheckpointTensor(scale, scale_shape(spec.shape), spec.param + SCALE_SUFFIX, spec.index)
            )
            scales_used.add(scale)
            formats[spec.param].add(dtype)
        elif dtype not in FLOAT_DTYPES:
            problems["non-float"].append(f"{name} is {dtype}")
        else:
            files[file].append(spec)
            formats[spec.param].add("float")
    problems["unexpected"] += [
        n for n in found if n.endswith(SCALE_SUFFIX) and n not in expected and n not in scales_used
    ]
    problems["missing"] = [name for name in expected if name not in found]
    problems["mixed-format"] = [f"{param} (from {sorted(kinds)})" for param, kinds in formats.items() if len(kinds) > 1]
    report = [
        f"{len(names)} {kind} tensor(s): {', '.join(names[:MAX_LISTED])}" + (", ..." if len(names) > MAX_LISTED else "")
        for kind, names in problems.items()
        if names
    ]
    if report:
        raise CheckpointError(f"{folder} does not match its config.json: " + "; ".join(report))
    if ignored:
        logger.info("ignoring %d tensors not used for serving (e.g. %s)", len(ignored), ignored[0])
    quantized = frozenset(param for param, kinds in formats.items() if kinds == {SAFETENSORS_FP8})
    if quantized:
        logger.info("%d parameters stay in MXFP8 with their scales", len(quantized))
    return CheckpointScan(files=dict(files), ignored=ignored, quantized=quantized)


def _fp8_problem(
    spec: CheckpointTensor, found: dict[str, tuple[Path, tuple[int, ...], str]], quantization: Mxfp8Config | None
) -> str | None:
    """Why the FP8 tensor ``spec`` cannot be served as MXFP8, or None."""
    name = spec.name
    if quantization is None:
        return f"{name} is {SAFETENSORS_FP8} but config.json has no quantization_config"
    if not quantizable(spec.param):
        return f"{name} is {SAFETENSORS_FP8}; embeddings, the LM head, routers, norms and the vision side serve in bf16"
    if quantization.ignores(name):
        return f"{name} is {SAFETENSORS_FP8} but quantization_config.ignored_layers keeps it in full precision"
    if spec.shape[-1] % BLOCK_SIZE:
        return f"{name} is {SAFETENSORS_FP8} but its {spec.shape[-1]} inputs are no whole {BLOCK_SIZE}-element blocks"
    scale = scale_name(name)
    if scale not in found:
        return f"{name} is {SAFETENSORS_FP8} without its scale {scale}"
    _, shape, dtype = found[scale]
    if dtype != SAFETENSORS_SCALE or shape != scale_shape(spec.shape):
        return f"{scale} is {dtype} {list(shape)}, expected {SAFETENSORS_SCALE} {list(scale_shape(spec.shape))}"
    return None


def load_weights(model: M3ForServing, scan: CheckpointScan) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    with (
        torch.no_grad(),
        tqdm(total=scan.num_tensors, unit="tensor", desc="loading weights", leave=False) as bar,
    ):
        for file, specs in scan.files.items():
            with safe_open(str(file), framework="pt") as reader:
                for spec in specs:
                    tensor = reader.get_tensor(spec.name)
                    target = params[spec.param][spec.index] if spec.index else params[spec.param]
                    if target.shape != tensor.shape:  # a bug in the name table, not in the checkpoint
                        raise AssertionError(f"{spec.name} {tuple(tensor.shape)} -> {spec.param} {tuple(target.shape)}")
                    target.copy_(tensor)
                    del tensor
                    bar.update()
    logger.info("loaded %d tensors from %d file(s)", scan.num_tensors, len(scan.files))
