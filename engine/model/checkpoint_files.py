"""Which files hold an HF-layout checkpoint's tensors, and their safetensors headers, read without torch.

A safetensors file starts with a little-endian u64 ``n`` and ``n`` bytes of JSON: ``{name: {"dtype", "shape",
"data_offsets"}, "__metadata__": {...}}``.  The loader (``loader.scan_checkpoint``) and the sizing check before
loading (``sizing``) read only these.
"""

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # the format's own bound on the header


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config.json."""


def shard_files(folder: Path) -> list[Path]:
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


def read_header(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every tensor of one safetensors file, from its header alone."""
    try:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(handle.read(length))
        return [
            (name, tuple(int(size) for size in entry["shape"]), str(entry["dtype"]))
            for name, entry in header.items()
            if name != "__metadata__"
        ]
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
