"""Copy whole KV pages between tensors laid out ``[planes, pages, *page]``: device to device, or to and from
pinned host memory, which the kernel reads and writes directly through unified addressing (no staging).

``dst[p, dst_index[i]] = src[p, src_index[i]]`` for every plane ``p`` and pair ``i < count``.  Planes are
e.g. (MSA layer, K/V) pairs, so one launch moves a block of every layer.  ``count`` may live on the
device (the decode resolver appends misses there): the kernel is a fixed grid of persistent programs
that loop over (pair, plane, chunk) work items, so its launch never needs the count on the host and a
CUDA graph can capture it.  A copy kernel instead of ``cudaMemcpyAsync`` per page: pages are 32-256 KiB,
where DMA is slow to start, and the pair list is only known on the device.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3stack.engine.host_copy import upload
from m3stack.engine.msa.launch import multiprocessors, triton_interpreted


@dataclass(frozen=True)
class CopyConfig:
    """Launch shape of the page copy (``bench/offload_copy.py`` sweeps it on the H200)."""

    # Elements one work item moves (a power of two; 4096 = 8 KiB of bf16): many items keep PCIe reads in flight.
    chunk_elements: int = 4096
    programs_per_sm: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.chunk_elements < 1 or self.chunk_elements & (self.chunk_elements - 1):
            raise ValueError(f"chunk_elements must be a power of two, got {self.chunk_elements}")
        if self.programs_per_sm < 1 or self.num_warps < 1:
            raise ValueError("programs_per_sm and num_warps must be >= 1")


@triton.jit
def _copy_pages_kernel(
    src_ptr, dst_ptr, src_index_ptr, dst_index_ptr, count_ptr, src_plane_stride, dst_plane_stride,
    PLANES: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    chunks: tl.constexpr = PAGE // CHUNK
    per_pair: tl.constexpr = PLANES * chunks
    total = tl.load(count_ptr) * per_pair
    offsets = tl.arange(0, CHUNK)
    wide = tl.program_id(0).to(tl.int64) * 0  # int64 zero: every address below is computed in 64 bits
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        pair = item // per_pair
        plane = wide + (item % per_pair) // chunks
        chunk = wide + item % chunks
        src_page = tl.load(src_index_ptr + pair).to(tl.int64)
        dst_page = tl.load(dst_index_ptr + pair).to(tl.int64)
        values = tl.load(src_ptr + plane * src_plane_stride + src_page * PAGE + chunk * CHUNK + offsets)
        tl.store(dst_ptr + plane * dst_plane_stride + dst_page * PAGE + chunk * CHUNK + offsets, values)


def _page_elements(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[2:])


def check_page_tensors(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() < 3 or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be [planes, pages, *page] alike")
    if src.dtype != dst.dtype:
        raise ValueError(f"src is {src.dtype}, dst is {dst.dtype}")
    page = _page_elements(src)
    for name, tensor in (("src", src), ("dst", dst)):
        if not tensor[0].is_contiguous() or tensor.stride(1) != page:
            raise ValueError(f"{name} needs contiguous pages within each plane")


@dataclass(frozen=True)
class PageCopyPlan:
    """The copy kernel's launch for one pair of page tensors, checked and shaped once (``plan_page_copy``), so
    that ``run`` is the launch alone: a decode step runs it per MSA layer, and the engine's copy timing starts
    right before it."""

    src: torch.Tensor
    dst: torch.Tensor
    programs: int
    page: int
    chunk: int
    num_warps: int

    def run(self, src_index: torch.Tensor, dst_index: torch.Tensor, count: torch.Tensor) -> None:
        """Copy pages ``src[:, src_index[i]] -> dst[:, dst_index[i]]`` for ``i < count`` (device tensors)."""
        _copy_pages_kernel[(self.programs,)](
            self.src, self.dst, src_index, dst_index, count, self.src.stride(0), self.dst.stride(0),
            PLANES=self.src.shape[0], PAGE=self.page, CHUNK=self.chunk, num_warps=self.num_warps,
        )  # fmt: skip


def plan_page_copy(src: torch.Tensor, dst: torch.Tensor, config: CopyConfig | None = None) -> PageCopyPlan:
    """Check ``src`` and ``dst`` (``[planes, pages, *page]`` alike) and shape the kernel's launch for them."""
    check_page_tensors(src, dst)
    config = config or CopyConfig()
    device = dst.device if dst.is_cuda else src.device
    page = _page_elements(src)
    return PageCopyPlan(src, dst, config.programs_per_sm * multiprocessors(device), page,
                        math.gcd(page, config.chunk_elements), config.num_warps)  # fmt: skip


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    count: torch.Tensor | None = None,
    *,
    torch_only: bool = False,
    config: CopyConfig | None = None,
) -> None:
    """Copy pages ``src[:, src_index[i]] -> dst[:, dst_index[i]]`` for ``i < count`` (a 1-element int tensor on
    the device; all pairs when None).  Index tensors live where the kernel runs (the device of the CUDA side).

    Destination pages must be distinct among the copied pairs.  On CUDA (or CPU under ``TRITON_INTERPRET=1``
    unless ``torch_only``) a Triton kernel runs; otherwise indexed assignment.
    """
    check_page_tensors(src, dst)
    device = dst.device if dst.is_cuda else src.device
    if count is None:
        count = upload(torch.tensor([src_index.numel()], dtype=torch.int32), device)
    if src_index.numel() == 0:
        return
    if (device.type == "cuda" or triton_interpreted()) and not torch_only:
        plan_page_copy(src, dst, config).run(src_index, dst_index, count)
        return
    n = int(count.reshape(-1)[0])
    source = src[:, src_index[:n].long().to(src.device)]
    dst[:, dst_index[:n].long().to(dst.device)] = source.to(dst.device)
