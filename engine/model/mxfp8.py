"""MXFP8 weights in the serving model: quantize, dequantize (the reference), and the parameters that hold them.

A quantized parameter ``P`` (a linear's ``weight`` ``[out, in]`` or the experts' ``gate_up_proj`` ``[E, 2I, H]``)
holds ``float8_e4m3fn`` values, and its module holds ``P_scale_inv``: ``uint8`` ``[..., in / 32]`` (stored
block-major, ``empty_scales``), an E8M0 exponent per block of 32 input elements (``quantization``).  Nothing is
dequantized at load: on CUDA the Triton kernels (``mxfp8_kernels``) widen the FP8 values and scales in registers
and multiply in bf16; elsewhere (the CPU, float32 on CUDA) ``dequantize`` rebuilds the weight for each call, which
is also the kernels' reference.
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model import mxfp8_kernels
from m3stack.engine.model.quantization import BLOCK_SIZE, E8M0_BIAS, SCALE_SUFFIX, scale_shape
from m3stack.sizing import MXFP8_SCRATCH_BYTES

WEIGHT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8
FP8_MAX = 448.0  # the largest finite e4m3 value
# Exponents a writer uses: byte 0 (2 ** -127) is left out, the kernels read it as 0; 255 is NaN in E8M0.
MIN_EXPONENT, MAX_EXPONENT = 1 - E8M0_BIAS, 254 - E8M0_BIAS
# MoE steps whose experts get at least this many rows each on average (token-expert pairs over the experts routed
# over) widen their experts into a bf16 scratch, a few experts at a time, and multiply through torch's grouped GEMM
# (``moe.MoE.grouped_dequantized``); smaller ones run the fused kernel, which reads half of bf16's weight bytes.
# Widening costs the experts' bytes whatever the step, the GEMMs' math grows with the rows an expert gets, so the
# crossover is a number of rows an expert, the same for any expert count and top-k.  ``bench.mxfp8_moe``'s
# measured crossover at M3's shapes (H200, 2026-12-04 14:57 UTC, commit 1b722f3, bench/results/mxfp8_moe.json):
# 8192 tokens at top-8 over 128 experts, 512 rows an expert (fused 0.558x BF16, dequant 0.621x); at 2048 tokens
# (128 rows an expert) the fused kernel is ahead (0.760x against 0.420x).  Sizes between were not measured.
DEQUANTIZE_FROM_ROWS_PER_EXPERT = 512
# Dense linears of more rows than this widen their weight into a scratch (at most M3's dense MLP, 302 MB in bf16,
# within DEQUANTIZE_SCRATCH_BYTES) and multiply through cuBLAS; up to it the kernel's GEMV, 16-row and swap_ab
# 32-row tiles run.  H200, commit 2b66387 (bench/results/mxfp8_linears_prefill.json): at 64 rows the kernel ran
# M3's linears 1.2-1.9x faster than widening + cuBLAS, at 256 rows 1.8-2.7x slower (its 128-row tiles over few
# output tiles); 65-255 rows were not measured.
DENSE_KERNEL_MAX_ROWS = 64
DEQUANTIZE_SCRATCH_BYTES = MXFP8_SCRATCH_BYTES  # their bf16 scratch: two chunks of experts, widened in turn


def is_quantized(weight: torch.Tensor) -> bool:
    return weight.dtype == WEIGHT_DTYPE


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., in]`` float -> (``float8_e4m3fn`` values, ``uint8`` E8M0 scales ``[..., in / 32]``).

    Each block's scale is the smallest power of two that brings its largest magnitude within e4m3's 448
    (``2 ** ceil(log2(amax / 448))``), so no value saturates; values round to the nearest e4m3.
    """
    blocks = weight.float().reshape(*weight.shape[:-1], -1, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax / 448 = mantissa * 2 ** exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two needs no rounding up
    exponent = torch.where(amax > 0, exponent, 0).clamp(MIN_EXPONENT, MAX_EXPONENT)
    scaled = blocks / torch.exp2(exponent.float())[..., None]
    values = scaled.clamp(-FP8_MAX, FP8_MAX).to(WEIGHT_DTYPE).reshape(weight.shape)
    return values, (exponent + E8M0_BIAS).to(SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * 2 ** (scales - 127)`` per 32-element block, in ``dtype`` (exact in bf16 and float32)."""
    if scales.shape != scale_shape(tuple(values.shape)):
        raise ValueError(f"scales {list(scales.shape)} do not fit weights {list(values.shape)}")
    factors = torch.exp2(scales.float() - E8M0_BIAS)
    blocks = values.float().reshape(*scales.shape, BLOCK_SIZE) * factors[..., None]
    return blocks.reshape(values.shape).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an MXFP8 ``W`` ``[out, in]``: the Triton kernel for bf16/fp16 on CUDA; past
    ``DENSE_KERNEL_MAX_ROWS`` rows, ``W`` widened into a scratch of ``x``'s dtype and cuBLAS's matmul."""
    if x.is_cuda and x.dtype in mxfp8_kernels.ACTIVATION_DTYPES:
        if x.numel() > DENSE_KERNEL_MAX_ROWS * x.shape[-1]:
            return F.linear(x, mxfp8_kernels.dequantize_matrix(weight, scales, x.dtype), bias)
        out = mxfp8_kernels.mxfp8_linear(x.reshape(-1, x.shape[-1]), weight, scales)
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, dequantize(weight, scales, x.dtype), bias)


def expert_weight(weights: torch.Tensor, scales: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s ``[N, K]`` matrix of a stacked ``[E, N, K]`` parameter, in ``dtype``."""
    if scales is None:
        return weights[expert]
    return dequantize(weights[expert], scales[expert], dtype)


def quantize_parameters(model: nn.Module, params: Iterable[str]) -> None:
    """Give each named parameter MXFP8 storage (same shape) and its module a ``<name>_scale_inv`` beside it.

    Run on a model built on the meta device, before it is materialized: the float storage is never allocated.
    """
    for path in sorted(params):
        module_path, _, attr = path.rpartition(".")
        module = model.get_submodule(module_path)
        old = getattr(module, attr)
        shape = tuple(old.shape)
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=WEIGHT_DTYPE, device=old.device), False))
        setattr(module, attr + SCALE_SUFFIX, nn.Parameter(empty_scales(shape, old.device), requires_grad=False))


def empty_scales(weight_shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Scales for a weight of ``weight_shape``: shaped ``[..., N, K / 32]`` as the checkpoint's, stored block-major
    (``[..., K / 32, N]`` in memory), so the kernels read one block's ``N`` scales as one contiguous row.  A
    checkpoint's row-major tensor is copied into it as is (``copy_`` transposes); ``to_empty`` and ``to`` keep it."""
    *leading, rows, blocks = scale_shape(weight_shape)
    return torch.empty((*leading, blocks, rows), dtype=SCALE_DTYPE, device=device).transpose(-1, -2)


def block_major(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` ``[..., N, K / 32]`` (same shape and values) in the kernels' block-major memory layout."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def widened_chunks(
    stacks: list[tuple[torch.Tensor, torch.Tensor]], chunks: list[tuple[int, int]], dtype: torch.dtype
) -> Iterator[tuple[tuple[int, int], list[torch.Tensor]]]:
    """Each chunk ``(first, last)`` of groups with every stack's ``weights[first:last]`` widened to ``dtype``
    (``mxfp8_kernels.dequantize_groups``; ``stacks`` are ``(weights, block-major scales)``).

    Two scratch buffers serve in turn.  On CUDA the next chunk widens on a side stream while the caller's work on
    this one runs on the current stream: widening is bound by memory, a large step's GEMMs by math.  A chunk's
    buffers are valid until the caller asks for the next-but-one chunk.
    """
    if not chunks:
        return
    device, size = stacks[0][0].device, max(last - first for first, last in chunks)
    scratch = [
        [torch.empty((size, *weights.shape[1:]), dtype=dtype, device=device) for weights, _ in stacks]
        for _ in range(min(2, len(chunks)))
    ]
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    current = torch.cuda.current_stream(device) if side is not None else None
    if side is not None:
        side.wait_stream(current)  # the scratch (and whatever wrote the weights) first
    ready: list[torch.cuda.Event | None] = []
    released: list[torch.cuda.Event | None] = [None] * len(scratch)

    def widen(index: int) -> None:
        (first, last), buffers = chunks[index], scratch[index % len(scratch)]
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None and released[index % len(scratch)] is not None:
                side.wait_event(released[index % len(scratch)])  # its previous chunk's work is done
            for (weights, scales), buffer in zip(stacks, buffers, strict=True):
                mxfp8_kernels.dequantize_groups(weights[first:last], scales[first:last], buffer[: last - first])
            ready.append(side.record_event() if side is not None else None)

    widen(0)
    for index, (first, last) in enumerate(chunks):
        if index + 1 < len(chunks):
            widen(index + 1)  # runs beside the caller's work on this chunk
        if current is not None:
            current.wait_event(ready[index])
        yield (first, last), [buffer[: last - first] for buffer in scratch[index % len(scratch)]]
        if current is not None:
            released[index % len(scratch)] = current.record_event()
