"""Load an HF-layout M3 checkpoint (safetensors, sharded with ``model.safetensors.index.json`` or single-file).

Two passes: ``scan_checkpoint`` reads only the safetensors headers and fails fast, listing every missing,
unexpected or mis-shaped tensor, before any data is read; then ``load_weights`` goes shard by shard and copies
one tensor at a time into the already-allocated parameters (converting dtype, moving to the device), so host
memory never holds more than one tensor and the device never holds two copies.
"""

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from m3stack.engine.model.config import M3Config, load_config
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.model.weights import IGNORED, CheckpointTensor, checkpoint_tensors

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_LISTED = 10  # names quoted per problem kind in an error message
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config.json."""


@dataclass(frozen=True)
class CheckpointScan:
    """Which file holds which expected tensor (all present with the right shapes)."""

    files: dict[Path, list[CheckpointTensor]]
    ignored: list[str]

    @property
    def num_tensors(self) -> int:
        return sum(len(specs) for specs in self.files.values())


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[M3ForServing, M3Config]:
    config = load_config(path)
    scan = scan_checkpoint(path, config)
    model = M3ForServing(config, dtype, device)
    load_weights(model, scan)
    return model.eval(), config


def scan_checkpoint(path: str | Path, config: M3Config) -> CheckpointScan:
    """Check every tensor's name, shape and dtype against ``config`` from the file headers alone."""
    folder = Path(path)
    expected = {spec.name: spec for spec in checkpoint_tensors(config)}
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    problems: dict[str, list[str]] = defaultdict(list)
    ignored: list[str] = []
    for file in _shard_files(folder):
        for name, shape, dtype in _headers(file):
            if IGNORED.search(name):
                ignored.append(name)
            elif name in found:
                problems["duplicated"].append(f"{name} (in {found[name][0].name} and {file.name})")
            else:
                found[name] = (file, shape, dtype)
    files: dict[Path, list[CheckpointTensor]] = defaultdict(list)
    for name, (file, shape, dtype) in found.items():
        spec = expected.get(name)
        if spec is None:
            problems["unexpected"].append(name)
        elif shape != spec.shape:
            problems["mis-shaped"].append(f"{name} is {list(shape)}, expected {list(spec.shape)}")
        elif dtype not in FLOAT_DTYPES:
            problems["non-float"].append(f"{name} is {dtype}")
        else:
            files[file].append(spec)
    problems["missing"] = [name for name in expected if name not in found]
    report = [
        f"{len(names)} {kind} tensor(s): {', '.join(names[:MAX_LISTED])}" + (", ..." if len(names) > MAX_LISTED else "")
        for kind, names in problems.items()
        if names
    ]
    if report:
        raise CheckpointError(f"{folder} does not match its config.json: " + "; ".join(report))
    if ignored:
        logger.info("ignoring %d tensors not used for serving (e.g. %s)", len(ignored), ignored[0])
    return CheckpointScan(files=dict(files), ignored=ignored)


def _headers(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every tensor in ``file``, without reading tensor data."""
    try:
        with safe_open(str(file), framework="pt") as reader:
            out = []
            for name in reader.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
                header = reader.get_slice(name)
                out.append((name, tuple(header.get_shape()), header.get_dtype()))
            return out
    except SafetensorError as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


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


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(absent)}")
    return files
