"""Where the MSA kernels run: Triton on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (CI)."""

import functools
import os

import torch


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether kernels over ``tensor`` go through Triton: CUDA tensors, or any tensor when interpreted."""
    return tensor.is_cuda or triton_interpreted()


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200); 4 stands in for CPU interpretation,
    which keeps interpreted grids small."""
    if device.type == "cuda":
        return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch (``launch_pdl``, ``gdc_wait``): CUDA devices of compute capability 9.0 and
    up (Hopper), never the CPU interpreter."""
    if device.type != "cuda" or triton_interpreted():
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """A Triton launch's keyword for programmatic dependent launch: only passed where used (other backends and the
    interpreter refuse the keyword)."""
    return {"launch_pdl": True} if enabled else {}
