"""Patch tensors on their way to the engine: POSIX shared-memory segments, and how an item's patches travel.

Workers write each item's patches straight into a segment ``/dev/shm/<name>`` that the gateway named
and sized from the plan, so nothing large crosses the worker pipe.  The tensor then travels either
inline in the gRPC message (the segment is read and removed) or, when gateway and engine share the
host and the tensor is large, as a ``ShmHandle`` that the engine reads and unlinks (``Transport`` says which;
``gateway.engine_client.wire`` builds the message).
"""

import contextlib
import mmap
import os
import uuid
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")


class WireDType(StrEnum):
    """uint8: raw pixels, the engine normalizes (4x fewer bytes than float32); bfloat16: normalized here."""

    UINT8 = "uint8"
    BFLOAT16 = "bfloat16"

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(np.uint8) if self is WireDType.UINT8 else np.dtype(np.uint16)  # bf16 as bit patterns


@dataclass(frozen=True)
class Transport:
    dtype: WireDType = WireDType.UINT8
    # Tensors of at least this many bytes go by shared memory; None: always inline (engine on another host).
    shm_threshold_bytes: int | None = None


def new_segment_name() -> str:
    return f"m3stack-mm-{os.getpid()}-{uuid.uuid4().hex}"


def create_segment(name: str, nbytes: int) -> None:
    """An empty segment of ``nbytes`` (owner-only permissions; an existing name is an error)."""
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def map_segment(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A writable array over the segment; it stays valid after the file is unlinked."""
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if size != expected:
            raise ValueError(f"segment {name} holds {size} bytes, expected {expected}")
        buffer = mmap.mmap(fd, size) if size else bytearray()
    finally:
        os.close(fd)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


def write_segment(name: str, data: bytes) -> None:
    create_segment(name, len(data))
    if data:
        map_segment(name, np.dtype(np.uint8), (len(data),))[:] = np.frombuffer(data, dtype=np.uint8)


def read_segment(name: str) -> bytes:
    return (SHM_DIR / name).read_bytes()
