"""Weight-only MXFP8 matmuls for Hopper in Triton: the dense linears and the MoE's grouped GEMM.

``out[r] = x[r] @ W[g].T`` where ``W[g] = fp8[g] * 2 ** (scale[g] - 127)`` per 32 input elements.  Hopper has
no microscaled tensor cores, so each program streams FP8 weight tiles and their E8M0 bytes from memory, widens
them in registers (e4m3 -> float32, times the block's power of two, -> the activations' dtype: exact, the
scaled value is a bf16 number) and runs bf16 tensor-core MMAs with float32 accumulation.  Decode steps are bound
by the weight bytes they read, which are half of bf16's.

Each program reads whole K tiles (rows, weights and the blocks' scales) and widens the weight tile at once: each
32-input block's power of two built once and repeated over its inputs, then one MMA a tile.  Widening and
multiplying one 32-input sub-tile at a time, as built first, ran M3's experts 1.5x slower at 512 tokens a step
and, in its fastest form (fp16 MMAs, the scales on the accumulator), 1.12-1.14x slower at 16-64 (bench/README.md,
"MXFP8 GEMV").  Options of ``Tiles`` that ``bench.mxfp8_gemv`` times beside the plan: ``widen`` 1 and 2, other
ways of widening e4m3 to bf16; ``swap_ab`` multiplies out.T = W x.T, the weight tile on the MMA's M side, which
Hopper's warpgroup MMAs need for few rows: the plan's tiles for dense linears of 17-64 rows.

Steps of a few rows run ``_mxfp8_gemv_kernel`` instead: one row a program on CUDA cores (FP8 -> float32, float32
products summed a 32-input block at a time, times the block's scale), each weight row read as 256 (experts) or 512
(dense) contiguous bytes a step.  A 16-row MMA tile over one row does 1/16th useful work and reads 128 bytes of a
weight row at a time; the GEMV streamed M3's experts at 3.2 TB/s on the H200 where those tiles reached 2.0.

Each kernel serves both: a dense linear is one group of ``rows`` rows; the grouped GEMM takes the expert-sorted
rows of ``moe.MoE._grouped`` with each group's end row (``ends``, on the device: no host sync, so decode steps
can be CUDA-graphed).  The grid has ``cdiv(rows, BLOCK_M) + min(groups, rows)`` row blocks, a bound on the
blocks the groups need whatever the routing (each non-empty group adds at most one partial block); each program
finds its group from the ends in registers (a cumulative sum over at most a few hundred groups) and leaves at once
when it has none.  Rows past the last group's end (pairs run on another rank) are not written.

Small grids (decode over few groups, narrow tensor-parallel shards) split K over programs that write float32
partials; the last program of each output tile to arrive (an atomic counter a tile) adds them in split order:
deterministic, and no second launch.

The scales are read block-major: the ``N`` bytes of one 32-input block contiguous (``mxfp8.block_major``, the
layout the model's parameters are given in memory; checkpoints store ``[N, K / 32]`` row-major), so a K tile's
scales are ``K / 32`` contiguous rows of ``N`` bytes.

``dequantize_groups`` widens whole FP8 matrices into a bf16 scratch the same way: the MoE's large steps can
multiply through torch's bf16 grouped GEMM instead (``moe.MoE.grouped_dequantized``), where the step is bound by
math rather than by weight reads.

``moe`` and ``params.Linear`` call these through ``mxfp8``; ``mxfp8.dequantize`` + a float matmul is the
reference the tests compare with (on CPU under ``TRITON_INTERPRET=1``, and on the H200 in ``tests/gpu``).
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from m3stack.engine.model.quantization import BLOCK_SIZE
from m3stack.engine.side_stream import on_side_stream

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_SMS = 132  # H100/H200; the grid sizing's guess where no CUDA device answers (the CPU interpreter)
MIN_PROGRAMS_PER_SM = 4  # below this many programs per SM, split K (H200, 1-row dense linears: 4 beat 2 by 10-25%)


@dataclass(frozen=True)
class Tiles:
    """One launch configuration (``split_k`` 0: chosen from the grid size)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0
    # _widen's WIDEN for bf16 activations (fp16 ones widen through float32)
    widen: int = 0
    # MMAs of out.T = W x.T: the weight tile is the MMA's M side (64-128 of its rows, which Hopper's warpgroup
    # MMAs need), the few activation rows its N side; not a default until the H200 has timed it (bench.mxfp8_gemv)
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.widen not in (0, 1, 2):
            raise ValueError(f"widen is 0, 1 or 2 (_widen's ways), got {self.widen}")

    @property
    def gemv(self) -> bool:
        """``block_m`` 1: the CUDA-core kernel, one row a program (``_mxfp8_gemv_kernel``); ``widen`` unused."""
        return self.block_m == 1


# By rows per group, from bench.mxfp8_gemv on the H200 (bench/README.md "MXFP8 GEMV"); each reads and widens whole
# K tiles, one MMA a tile.  At M3's 64-token decode step the 16-row tiles ran the experts 1.96x (gate|up) and 1.99x
# (down) torch's bf16 grouped GEMM, where fp16 MMAs with the scales on the accumulator, one 32-input sub-tile at a
# time (an option until 2026-12-04), ran 1.72x / 1.77x, and 12-14% slower than these at 16 and 32 tokens too.
# Dense linears of 17-64 rows multiply out.T = W x.T (the weights on the warpgroup MMA's M side): 64 rows of q in
# 54 us against 75 for the 64-row tiles (cuBLAS's bf16: 37); past 64 rows mxfp8.linear widens the weight and calls
# cuBLAS.  Compiled for sm_90 by Triton 3.6 without spills: decode 120 registers (4 CTAs a SM), dense medium 127
# (4), medium 168 (3), prefill 128 (2).
DECODE_TILES = Tiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
DENSE_MEDIUM_TILES = Tiles(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True)
MEDIUM_TILES = Tiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
PREFILL_TILES = Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
# One row a program on CUDA cores, for steps of a few rows; up to where it stops beating the MMA tiles on the H200
# (python -m bench.mxfp8_gemv, bench/README.md "MXFP8 GEMV"): each row's program widens the weights again, so its
# time grows with the rows where the MMA tiles' does not.  M3's experts: 1.6x the MMA decode tiles at 1 token, 1.2x
# at 8 tokens (64 pairs), slower at 16; dense linears: 1.0-1.6x cuBLAS's bf16 at 1 row, 1.0-1.1x at 2, slower at 4.
GEMV_TILES = Tiles(block_m=1, block_n=16, block_k=512, num_warps=4, num_stages=1)
# The experts' GEMV reads 256 bytes a weight row a step: faster than 512 in every grouped case it runs (M3's experts
# at 1-8 tokens by 1-6%, 16 experts at top-4 by 5-20%: bench/results/mxfp8_gemv*.json); dense linears keep 512
# (256 was 12-16% slower for q, o and the MLPs' down projections at 1-2 rows).
GROUPED_GEMV_TILES = replace(GEMV_TILES, block_k=256)
GEMV_MAX_ROWS = 2  # dense linears
# Grouped GEMMs: up to this many token-expert pairs (8 tokens at M3's top-8), and no more pairs than experts routed
# over: the GEMV's time grows with an expert's rows (M3: 1.2x the MMA tiles at 64 pairs over 128 experts, even at
# 128; the serving benchmark's 16 experts at 64 pairs ran its MoE model 0.78x BF16 against 1.26x at 16 pairs).
GEMV_MAX_PAIRS = 64
# dequantize_groups' tile: 16 KiB of FP8 read and 32 KiB of bf16 written a program.
DEQUANTIZE_BLOCK_N, DEQUANTIZE_BLOCK_K = 64, 256


@triton.jit
def _widen(w, s, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """FP8 values ``w`` times ``2 ** (s - 127)`` (``s`` broadcast over ``w``), in ``DTYPE``: exact, the product is
    a bf16 number.

    ``WIDEN`` 0: through float32 (a byte of 0, 2 ** -127, reads as 0: no writer uses it); 1: e4m3 -> ``DTYPE``
    and the power of two built as ``DTYPE`` bits (bf16 only); 2: as 1 through fp16 (Triton converts e4m3 to fp16
    in one instruction per pair)."""
    return _widen_by(w, _block_factors(s, DTYPE, WIDEN), DTYPE, WIDEN)


@triton.jit
def _block_factors(s, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """The powers of two ``2 ** (s - 127)`` of E8M0 bytes ``s``, in the type ``_widen_by`` multiplies in."""
    if WIDEN == 0:
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        return (s.to(tl.int16) << 7).to(DTYPE, bitcast=True)


@triton.jit
def _widen_by(w, factors, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """``_widen`` with the blocks' powers of two already built (``_block_factors``, broadcast over ``w``)."""
    if WIDEN == 0:
        return (w.to(tl.float32) * factors).to(DTYPE)
    elif WIDEN == 1:
        return w.to(DTYPE) * factors
    else:
        return w.to(tl.float16).to(DTYPE) * factors


@triton.jit
def _widen_tile(w, s, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """A whole ``[BLOCK_K, BLOCK_N]`` FP8 tile ``w`` widened by its blocks' scales ``s`` ``[BLOCK_K / 32,
    BLOCK_N]``: each block's powers of two built once, then repeated over its 32 inputs."""
    blocks: tl.constexpr = s.shape[0]
    factors = _block_factors(s, DTYPE, WIDEN)
    factors = tl.reshape(tl.broadcast_to(factors[:, None, :], (blocks, 32, s.shape[1])), (blocks * 32, s.shape[1]))
    return _widen_by(w, factors, DTYPE, WIDEN)


@triton.jit
def _mxfp8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, partials_ptr, counters_ptr, ends_ptr,
    rows, n, k, k_per_split,
    stride_x, stride_wg, stride_wn, stride_sg, stride_sk, stride_split, stride_partial, stride_out,
    GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` output tile of one group over ``k_per_split`` inputs (program axis 2).

    Split K (``SPLIT`` programs a tile): each writes its float32 partial, and the last to arrive at the tile's
    counter adds them all in split order into ``out`` and sets the counter back to 0."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GROUPS == 0:  # a dense linear: one group of every row
        group = 0
        row_start = pid_m * BLOCK_M
        row_end = rows
    else:
        # Group g owns rows [ends[g-1], ends[g]) and cdiv(count, BLOCK_M) row blocks, numbered in group order.
        g = tl.arange(0, GROUPS_P)
        real = g < GROUPS
        ends = tl.load(ends_ptr + g, mask=real, other=0)
        starts = tl.load(ends_ptr + g - 1, mask=real & (g > 0), other=0)
        blocks = tl.where(real, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        block_ends = tl.cumsum(blocks, axis=0)
        group = tl.sum((block_ends <= pid_m).to(tl.int32), axis=0)
        if group >= GROUPS:  # past the last block the groups need
            return
        mine = g == group
        first_block = tl.sum(tl.where(mine, block_ends - blocks, 0), axis=0)
        row_start = tl.sum(tl.where(mine, starts, 0), axis=0) + (pid_m - first_block) * BLOCK_M
        row_end = tl.sum(tl.where(mine, ends, 0), axis=0)

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < row_end
    mask_n = offs_n < n
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)  # unhinted, it leaves every load unvectorized
    k_stop = tl.minimum(k, k_start + k_per_split)
    # The scales are block-major (a block's N scales contiguous: _launch checks it), so a K tile's scales are
    # BLOCK_K / 32 contiguous rows.  A [BLOCK_K, BLOCK_N] gather of scale bytes instead (one load per weight) ran the
    # MoE layer at 1.3 TB/s on the H200.
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    w_cols = w_ptr + group.to(tl.int64) * stride_wg + offs_n[None, :].to(tl.int64) * stride_wn
    s_cols = s_ptr + group.to(tl.int64) * stride_sg + offs_n[None, :]
    # SWAP_AB: out.T's tile, the weights' rows on the MMA's M side
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Whole K tiles: [BLOCK_M, BLOCK_K] rows, [BLOCK_K, BLOCK_N] weights and their [BLOCK_K / 32, BLOCK_N] scales
    # (block-major: each block's row contiguous), one MMA a tile.
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_b = k_start // 32 + tl.arange(0, BLOCK_K // 32)
    for kk in range(0, k_per_split, BLOCK_K):
        k_blocks = offs_b + kk // 32
        if not EVEN_K:  # past k: the last block's scales, over weights masked to 0
            k_blocks = tl.minimum(k_blocks, k // 32 - 1)
        x, w, s = _load_k_tile(x_rows, w_cols, s_cols + k_blocks[:, None] * stride_sk, offs_k + kk, k_stop, mask_m,
                               mask_n, EVEN_K)  # fmt: skip
        wide = _widen_tile(w, s, x_ptr.dtype.element_ty, WIDEN)
        acc = tl.dot(tl.trans(wide), tl.trans(x), acc) if SWAP_AB else tl.dot(x, wide, acc)

    if SWAP_AB:
        acc = tl.trans(acc)
    mask = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tile_partials = partials_ptr + offs_m[:, None].to(tl.int64) * stride_partial + offs_n[None, :]
    counter = counters_ptr + pid_m * tl.num_programs(1) + pid_n
    _store_tile(acc, out_ptrs, tile_partials, mask, counter, pid_k, stride_split, SPLIT)


@triton.jit
def _load_k_tile(x_rows, w_cols, scale_ptrs, in_k, k_stop, mask_m, mask_n, EVEN_K: tl.constexpr):
    """Rows ``x`` ``[M, K']``, weights ``w`` ``[K', N]`` at inputs ``in_k`` and their blocks' scales at
    ``scale_ptrs``; past ``k_stop`` (only where not ``EVEN_K``) rows and weights read 0 and the scales' pointers
    stay in bounds.  Masks only where needed: a mask along K leaves the loads unvectorized."""
    if EVEN_K:
        x = tl.load(x_rows + in_k[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_cols + in_k[:, None], mask=mask_n[None, :], other=0.0)
    else:
        live = in_k < k_stop
        x = tl.load(x_rows + in_k[None, :], mask=mask_m[:, None] & live[None, :], other=0.0)
        w = tl.load(w_cols + in_k[:, None], mask=live[:, None] & mask_n[None, :], other=0.0)
    return x, w, tl.load(scale_ptrs, mask=mask_n[None, :], other=0)


@triton.jit
def _store_tile(acc, out_ptrs, tile_partials, mask, counter, pid_k, stride_split, SPLIT: tl.constexpr):
    """Store a program's float32 ``acc`` into ``out``; under split K (``SPLIT`` programs a tile) its partial, and
    the last program to arrive at the tile's ``counter`` adds them all in split order into ``out`` and sets the
    counter back to 0."""
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(tile_partials + pid_k * stride_split, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the counter says so
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            # L2 reads (.cg): the other programs' partials, never L1's copy
            total = tl.load(tile_partials, mask=mask, other=0.0, cache_modifier=".cg")
            for split in tl.static_range(1, SPLIT):
                total += tl.load(tile_partials + split * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _mxfp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, partials_ptr, counters_ptr, ends_ptr,
    n, k, k_per_split,
    stride_x, stride_wg, stride_wn, stride_sg, stride_sk, stride_split, stride_partial, stride_out,
    GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)`` times ``BLOCK_N`` weight rows of its group over ``k_per_split`` inputs (axis 2), on
    CUDA cores: FP8 widened to float32, multiplied by the row in float32, summed a 32-input block at a time and
    times the block's scale.  Each weight row is read as ``BLOCK_K`` contiguous bytes a step (256 or 512), where
    the MMA tiles read 128 a row; a 16-row MMA over one row is 1/16th useful."""
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    group = 0
    if GROUPS > 0:  # the row's group: how many groups end at or before it
        g = tl.arange(0, GROUPS_P)
        ends = tl.load(ends_ptr + g, mask=g < GROUPS, other=2**31 - 1)
        group = tl.sum((ends <= row).to(tl.int32), axis=0)
        if group >= GROUPS:  # a pair of another rank: no group runs it
            return
    blocks: tl.constexpr = BLOCK_K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    offs_b = tl.arange(0, blocks)
    inner = tl.arange(0, 32)
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_stop = tl.minimum(k, k_start + k_per_split)
    # [BLOCK_N, blocks, 32] weights, [BLOCK_N, blocks] scales (block-major: a block's N scales contiguous), and
    # the row's [blocks, 32] inputs, all at this split's first K tile.
    w_tile = (w_ptr + group.to(tl.int64) * stride_wg + offs_n[:, None, None].to(tl.int64) * stride_wn
              + k_start + offs_b[None, :, None] * 32 + inner[None, None, :])  # fmt: skip
    s_tile = s_ptr + group.to(tl.int64) * stride_sg + (k_start // 32 + offs_b[None, :]) * stride_sk + offs_n[:, None]
    x_tile = x_ptr + row.to(tl.int64) * stride_x + k_start + offs_b[:, None] * 32 + inner[None, :]
    acc = tl.zeros((BLOCK_N, blocks), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_tile + kk, mask=mask_n[:, None, None], other=0.0)
            s = tl.load(s_tile + (kk // 32) * stride_sk, mask=mask_n[:, None], other=0)
            x = tl.load(x_tile + kk)
        else:  # K is whole blocks (_check_layout): a block is in or out as a whole, the loads stay vectorized
            live = k_start + kk + offs_b * 32 < k_stop
            w = tl.load(w_tile + kk, mask=mask_n[:, None, None] & live[None, :, None], other=0.0)
            s = tl.load(s_tile + (kk // 32) * stride_sk, mask=mask_n[:, None] & live[None, :], other=0)
            x = tl.load(x_tile + kk, mask=live[:, None], other=0.0)
        block_sums = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :, :], axis=2)
        acc += block_sums * (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    result = tl.sum(acc, axis=1)
    out_ptrs = out_ptr + row.to(tl.int64) * stride_out + offs_n
    tile_partials = partials_ptr + row.to(tl.int64) * stride_partial + offs_n
    counter = counters_ptr + row * tl.num_programs(1) + pid_n
    _store_tile(result, out_ptrs, tile_partials, mask_n, counter, pid_k, stride_split, SPLIT)


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, n, k,
    stride_wg, stride_wn, stride_sg, stride_sk, stride_og, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_N, BLOCK_K]`` tile of group ``program_id(0)``'s weights widened to the output's dtype, read as
    32-input sub-tiles with one contiguous row of (block-major) scales each."""
    group = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    k_start = tl.program_id(2) * BLOCK_K
    w_rows = w_ptr + group * stride_wg + offs_n[:, None].to(tl.int64) * stride_wn
    out_rows = out_ptr + group * stride_og + offs_n[:, None].to(tl.int64) * stride_on
    for j in tl.static_range(BLOCK_K // 32):
        first = k_start + j * 32
        offs_k = first + tl.arange(0, 32)
        # k is whole blocks: one bound a sub-tile (constant along it) keeps the accesses vectorized.
        live = mask_n[:, None] & (tl.zeros([1, 32], dtype=tl.int32) + first < k)
        w = tl.load(w_rows + offs_k[None, :], mask=live, other=0.0)
        s = tl.load(s_ptr + group * stride_sg + (first // 32) * stride_sk + offs_n[:, None], mask=live, other=0)
        tl.store(out_rows + offs_k[None, :], _widen(w, s, out_ptr.dtype.element_ty, 0), mask=live)


def dequantize_groups(weights: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """MXFP8 ``weights`` ``[G, N, K]`` (block-major ``scales`` ``[G, N, K / 32]``) widened into ``out`` (bf16 or
    fp16, ``[G, N, K]``, last dimension contiguous): the exact values, for a grouped GEMM in ``out``'s dtype."""
    groups, n, k = weights.shape
    if out.shape != weights.shape or out.dtype not in ACTIVATION_DTYPES or out.stride(2) != 1:
        raise ValueError(f"out must be bf16/fp16 {tuple(weights.shape)}, got {out.dtype} {tuple(out.shape)}")
    _check_layout(weights, scales)
    grid = (groups, triton.cdiv(n, DEQUANTIZE_BLOCK_N), triton.cdiv(k, DEQUANTIZE_BLOCK_K))
    _dequantize_kernel[grid](
        weights, scales, out, n, k,
        weights.stride(0), weights.stride(1), scales.stride(0), scales.stride(2), out.stride(0), out.stride(1),
        BLOCK_N=DEQUANTIZE_BLOCK_N, BLOCK_K=DEQUANTIZE_BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out


def dequantize_matrix(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One MXFP8 matrix ``[N, K]`` (block-major ``scales``) widened into a new ``[N, K]`` tensor of ``dtype``."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    dequantize_groups(weight[None], scales[None], out[None])
    return out


def mxfp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, tiles: Tiles | None = None
) -> torch.Tensor:
    """``x`` ``[M, K]`` times an MXFP8 ``weight`` ``[N, K]`` (block-major ``scales`` ``[N, K / 32]``) transposed:
    ``[M, N]``."""
    return _launch(x, weight[None], scales[None], None, tiles)


def mxfp8_grouped_mm(
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor,
    ends: torch.Tensor,
    tiles: Tiles | None = None,
    routed_experts: int | None = None,
) -> torch.Tensor:
    """Rows ``ends[g-1]:ends[g]`` of ``x`` ``[P, K]`` times ``weights[g]`` ``[N, K]`` transposed: ``[P, N]``.

    ``ends`` ``[G]`` int32 on the device, non-decreasing; rows from ``ends[-1]`` on are left unwritten.
    ``routed_experts``: how many experts the rows were routed over (default ``G``; more under expert parallelism,
    where the rows include other ranks' pairs), which sets the rows an expert gets for the launch's plan."""
    if ends.shape != (weights.shape[0],):
        raise ValueError(f"ends {tuple(ends.shape)} must hold one end row per group ({weights.shape[0]})")
    return _launch(x, weights, scales, ends, tiles, routed_experts)


def choose_tiles(rows: int, groups: int, routed_experts: int | None = None) -> Tiles:
    """The launch configuration for ``rows`` rows over ``groups`` groups (1: a dense linear) routed over
    ``routed_experts`` (default ``groups``): the GEMV up to a few rows (a row an expert for grouped GEMMs), else by
    rows per group.  Chosen for the rows rounded up to a power of two, as a CUDA graph's padded batch rounds them
    (``plan_launch``)."""
    bucket = triton.next_power_of_2(rows)
    gemv_rows = min(GEMV_MAX_PAIRS, routed_experts or groups) if groups > 1 else GEMV_MAX_ROWS
    if bucket <= gemv_rows:
        return GROUPED_GEMV_TILES if groups > 1 else GEMV_TILES
    # Under expert parallelism the rows hold every rank's pairs over all routed experts: a group gets its share of
    # those, not rows / groups (16 of 128 experts at 64 tokens: 4 rows each, not 32).
    rows_per_group = rows / max(1, min(rows, routed_experts or groups))
    if rows_per_group <= 16:
        return DECODE_TILES
    if rows_per_group <= 64:
        return MEDIUM_TILES if groups > 1 else DENSE_MEDIUM_TILES
    return PREFILL_TILES


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch over ``rows`` rows runs: its tiles, K tile, and K split (``split`` programs of ``k_per_split``
    inputs each, partial sums added in a fixed order).  A row's result depends on its inputs and on this plan only
    (each row is one program's, whatever its neighbours), so where a padded CUDA-graph batch plans as the eager
    batch it pads, both give the same bits (tests/engine/model/test_mxfp8_format.py checks M3's and the tiny
    model's shapes)."""

    tiles: Tiles
    block_k: int
    k_per_split: int
    split: int


def plan_launch(
    rows: int,
    n: int,
    k: int,
    groups: int | None,
    device: torch.device,
    tiles: Tiles | None = None,
    routed_experts: int | None = None,
) -> LaunchPlan:
    """The plan of ``rows`` rows times ``[N, K]`` weights: one dense matrix (``groups`` None) or ``groups`` of them
    (rows routed over ``routed_experts``: ``mxfp8_grouped_mm``)."""
    tiles = tiles or choose_tiles(rows, groups or 1, routed_experts)
    block_k = min(tiles.block_k, triton.next_power_of_2(k))
    n_blocks = triton.cdiv(n, tiles.block_n)
    # Programs with work: a dense grid is all of them; a grouped one at most one block per non-empty group plus
    # one per BLOCK_M rows.  Counted for the rows rounded up to a power of two: a decode step of R tokens and the
    # CUDA graph of its padded batch (1, 2, 4, 8, then multiples of 16 tokens; times a power-of-two top-k) round
    # alike, so they split K alike (eager 5 tokens at M3's top-4 and TP=8 split in 2, their graph of 8 did not).
    bucket = triton.next_power_of_2(rows)
    if tiles.gemv or groups is None:
        busy_row_blocks = triton.cdiv(bucket, tiles.block_m)
    else:
        busy_row_blocks = min(bucket, groups) + bucket // tiles.block_m
    split = tiles.split_k or _split_for(device, busy_row_blocks * n_blocks, k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return LaunchPlan(tiles, block_k, k_per_split, triton.cdiv(k, k_per_split))


def _launch(
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor,
    ends: torch.Tensor | None,
    tiles: Tiles | None,
    routed_experts: int | None = None,
) -> torch.Tensor:
    groups, n, k = weights.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [rows, {k}] for weights {tuple(weights.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be bf16 or fp16 for the MXFP8 kernels, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x needs a contiguous last dimension")
    _check_layout(weights, scales)
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grouped = ends is not None
    plan = plan_launch(rows, n, k, groups if grouped else None, x.device, tiles, routed_experts)
    tiles, block_k, k_per_split, split = plan.tiles, plan.block_k, plan.k_per_split, plan.split
    n_blocks = triton.cdiv(n, tiles.block_n)
    row_blocks = _row_blocks(rows, groups if grouped else None, tiles)
    partials = out if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
    counters = out if split == 1 else split_counters(x.device, row_blocks * n_blocks)
    # Rows past the groups' ends stay unwritten in every partial; their sum is as undefined as the rows.
    common = dict(GROUPS=groups if grouped else 0, GROUPS_P=triton.next_power_of_2(groups) if grouped else 1,
                  SPLIT=split, EVEN_K=k % k_per_split == 0 and k_per_split % block_k == 0, BLOCK_N=tiles.block_n,
                  BLOCK_K=block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip
    strides = (x.stride(0), weights.stride(0), weights.stride(1), scales.stride(0), scales.stride(2),
               partials.stride(0) if split > 1 else 0, partials.stride(-2), out.stride(0))  # fmt: skip
    if tiles.gemv:
        _mxfp8_gemv_kernel[(row_blocks, n_blocks, split)](
            x, weights, scales, out, partials, counters, ends if grouped else x, n, k, k_per_split, *strides, **common
        )
        return out
    _mxfp8_matmul_kernel[(row_blocks, n_blocks, split)](
        x, weights, scales, out, partials, counters, ends if grouped else x, rows, n, k, k_per_split, *strides,
        BLOCK_M=tiles.block_m, SWAP_AB=tiles.swap_ab, WIDEN=tiles.widen if x.dtype == torch.bfloat16 else 0, **common,
    )  # fmt: skip
    return out


def _row_blocks(rows: int, groups: int | None, tiles: Tiles) -> int:
    """The grid's row blocks.  The GEMV has one program a row.  Grouped MMA tiles: past the blocks the groups need,
    programs leave at once, but a grid of cdiv(rows) + groups row blocks made a one-token step launch 16x the
    programs it runs, and the ones that run wait behind them; each non-empty group adds at most one partial block."""
    if tiles.gemv:
        return rows
    return triton.cdiv(rows, tiles.block_m) + (min(groups, rows) if groups is not None else 0)


_COUNTERS: dict[tuple[torch.device, bool], torch.Tensor] = {}  # by device and whether on its side stream
COUNTERS_MIN = 65536  # tiles a device's counters cover at first (256 KiB); M3's decode launches need < 1,000


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``tiles`` output tiles of a split-K launch on ``device``.

    The launch's last program a tile sets its counter back to 0, so one buffer serves every launch after it, eager
    or replayed from a CUDA graph: no memset and no sum kernel a launch (torch's sum and copy took 9 us of a 1-token
    step's split linear on the H200, a sum kernel 2.5 us).  A device's launches on its main stream run one after
    another, and so do those on its side stream (``engine.side_stream``: the MoE's shared expert), but the two may
    overlap: each has its own buffer.  During CUDA graph capture a buffer too small is not grown (its
    memory would come from the graph's pool): the launch gets counters of its own, zeroed by a memset the graph
    replays."""
    key = (device, device.type == "cuda" and on_side_stream(device))
    counters = _COUNTERS.get(key)
    if counters is not None and counters.numel() >= tiles:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    _COUNTERS[key] = torch.zeros(max(tiles, COUNTERS_MIN), dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _check_layout(weights: torch.Tensor, scales: torch.Tensor) -> None:
    """FP8 ``[G, N, K]`` with contiguous rows and E8M0 ``[G, N, K / 32]`` stored block-major (``mxfp8.block_major``:
    the ``N`` scales of one block contiguous), which is how the kernels read them."""
    groups, n, k = weights.shape
    if scales.shape != (groups, n, k // BLOCK_SIZE) or k % BLOCK_SIZE:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit weights {tuple(weights.shape)}")
    if weights.stride(2) != 1:
        raise ValueError("weights need a contiguous last dimension")
    if scales.stride(1) != 1 and n > 1:
        raise ValueError(f"scales must be block-major (mxfp8.block_major), got strides {scales.stride()}")


def _split_for(device: torch.device, programs: int, k: int, block_k: int) -> int:
    """K splits that bring ``programs`` up to ``MIN_PROGRAMS_PER_SM`` per SM, each split at least 4 K tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    wanted = triton.cdiv(MIN_PROGRAMS_PER_SM * sms, max(1, programs))
    return max(1, min(wanted, k // (4 * block_k)))
