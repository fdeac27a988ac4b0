"""The MXFP8 format: quantization_config parsing, quantize/dequantize, and the Triton kernels (interpreted on CPU).

The kernels run here with fp16 activations: Triton's CPU interpreter multiplies bf16 dot operands as their raw
uint16 bits (3.9), and so it does in bf16 elementwise products, so bf16 MMAs and ``_widen``'s bf16-multiply paths
(1, 2) are checked on the H200 (tests/gpu/test_mxfp8.py); its float32 path (0) is checked here on its own.  The
fp16-MMA tiles (``widen`` 3, decode's) convert bf16 rows to fp16 before their MMA, so they run here on bf16 too.
"""

import dataclasses
import itertools
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch
import triton
import triton.language as tl

from m3stack.engine.model import mxfp8, mxfp8_kernels
from m3stack.engine.model.config import ConfigError, TextConfig, parse_config
from m3stack.engine.model.mxfp8_kernels import Tiles
from m3stack.engine.model.quantization import QuantizationError, is_ignored, parse_quantization_config
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.runtime.cuda_graphs import capture_sizes

RELEASE_CONFIG = {
    "quant_method": "mxfp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [1, 32],
    "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower"],
}


def random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def test_the_release_config_parses_and_names_its_ignored_modules() -> None:
    config = parse_quantization_config(RELEASE_CONFIG)
    assert config is not None and config.to_json() == RELEASE_CONFIG
    assert config.ignores("language_model.lm_head.weight")
    assert config.ignores("language_model.model.embed_tokens.weight")
    assert config.ignores("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight")
    assert not config.ignores("language_model.model.layers.3.self_attn.q_proj.weight")
    # Whole dotted segments only: "lm_head" does not name "lm_head_extra".
    assert not is_ignored("language_model.lm_head_extra.weight", ["lm_head"])
    assert is_ignored(
        "language_model.model.layers.3.block_sparse_moe.gate.weight", ["model.layers.3.block_sparse_moe.gate"]
    )
    assert parse_quantization_config(None) is None
    assert parse_quantization_config({**RELEASE_CONFIG, "modules_to_not_convert": None}) is not None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method='fp8' is not supported.*mxfp8"),
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
        ({**RELEASE_CONFIG, "weight_block_size": [1, 16]}, r"weight_block_size=\[1, 16\]"),
        ({**RELEASE_CONFIG, "activation_scheme": "static"}, "activation_scheme='static'"),
        ({**RELEASE_CONFIG, "scale_fmt": "float"}, "scale_fmt='float'"),
        ({**RELEASE_CONFIG, "ignored_layers": "lm_head"}, "ignored_layers must be a list"),
        ("mxfp8", "must be an object"),
    ],
)
def test_other_quantization_is_refused_naming_the_method(raw, match) -> None:
    with pytest.raises(QuantizationError, match=match):
        parse_quantization_config(raw)
    with pytest.raises(ConfigError, match=match):  # and so is a config.json that carries it
        parse_config({"model_type": "minimax_m3_vl", "quantization_config": raw})


def test_quantize_picks_the_smallest_power_of_two_that_fits_each_block() -> None:
    weight = random(7, 96, seed=1, scale=0.02)
    weight[3, 32:64] *= 1e4  # blocks of very different magnitude in one row
    weight[5, :32] = 0.0  # an all-zero block
    values, scales = mxfp8.quantize(weight)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (7, 3)
    block_max = values.float().abs().reshape(7, 3, 32).amax(-1)
    nonzero = weight.reshape(7, 3, 32).abs().amax(-1) > 0
    assert (block_max[nonzero] <= 448).all() and (block_max[nonzero] >= 224).all()  # > 224 before rounding
    assert (values.float()[5, :32] == 0).all()
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 of its magnitude) of the original.
    restored = mxfp8.dequantize(values, scales)
    assert ((restored - weight).abs() <= weight.abs() / 16 + 1e-30).all()


def test_dequantize_then_quantize_gives_back_the_same_bytes() -> None:
    """Any valid MXFP8 tensor is a fixed point: dequantize is exact and quantize recovers its scales."""
    generator = torch.Generator().manual_seed(2)
    values = (torch.randn(16, 128, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    values[:, ::32] = 448.0  # the largest magnitude of every block is e4m3's largest
    scales = torch.randint(100, 140, (16, 4), generator=generator, dtype=torch.uint8)
    again_values, again_scales = mxfp8.quantize(mxfp8.dequantize(values, scales))
    assert torch.equal(again_scales, scales)
    assert torch.equal(again_values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(mxfp8.dequantize(values, scales, torch.bfloat16).float(), mxfp8.dequantize(values, scales))


def _reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ mxfp8.dequantize(values, scales).double().T


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (5, 96, 128, Tiles(16, 32, 64, 4, 1)),  # K over two tiles
        (3, 40, 96, Tiles(16, 32, 64, 4, 1)),  # N and K past a tile's edge (K not a multiple of the tile)
        (37, 64, 256, Tiles(16, 64, 64, 4, 1, split_k=3)),  # split K, uneven split, several row blocks
        (37, 64, 256, Tiles(16, 64, 64, 4, 1, split_k=3, swap_ab=True)),  # out.T = W x.T, the same cases
        (3, 40, 96, Tiles(16, 32, 64, 4, 1, swap_ab=True)),
    ],
)
def test_dense_kernel_matches_the_dequantized_reference(rows: int, n: int, k: int, tiles: Tiles) -> None:
    values, scales = mxfp8.quantize(random(n, k, seed=rows, scale=0.05))
    x = random(rows, k, seed=rows + 1).half()
    out = mxfp8_kernels.mxfp8_linear(x, values, mxfp8.block_major(scales), tiles)
    assert out.shape == (rows, n) and out.dtype == torch.float16
    assert relative_error(out, _reference(x, values, scales)) < 2e-3


GEMV = Tiles(1, 16, 64, 4, 1)


def test_grouped_kernel_runs_each_group_on_its_rows_and_skips_empty_groups() -> None:
    groups, n, k = 5, 48, 96
    values, scales = mxfp8.quantize(random(groups, n, k, seed=3, scale=0.1))
    counts = [3, 0, 18, 1, 0]  # empty groups, and a group spanning two row blocks
    skipped = 4  # rows past the last group's end: pairs of another rank, left unwritten
    x = random(sum(counts) + skipped, k, seed=4).half()
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    # MMA tiles and the GEMV (one row a program), each with and without a K split
    swapped = Tiles(16, 32, 32, 4, 1, split_k=2, swap_ab=True)
    for tiles in (Tiles(16, 32, 64, 4, 1), Tiles(16, 32, 32, 4, 1, split_k=2), swapped, GEMV,
                  Tiles(1, 32, 32, 4, 1, split_k=2)):  # fmt: skip
        out = mxfp8_kernels.mxfp8_grouped_mm(x, values, mxfp8.block_major(scales), ends, tiles)
        start = 0
        for group, count in enumerate(counts):
            rows = slice(start, start + count)
            if count:
                assert relative_error(out[rows], _reference(x[rows], values[group], scales[group])) < 2e-3
            start += count


def test_mma_tiles_keep_each_row_accurate_whatever_its_magnitude() -> None:
    """fp16 rows of different magnitudes and a zero row: each row within fp16's rounding of the reference (the
    weights widen to the rows' dtype exactly).  bf16 rows get the same check on the GPU (tests/gpu/test_mxfp8.py):
    the CPU interpreter's bf16 MMAs give garbage (Triton 3.x: a 16x16 bf16 tl.dot off by ~1e10)."""
    values, scales = mxfp8.quantize(random(40, 96, seed=11, scale=0.05))
    magnitudes = [1.0, 300.0, 2.0**-10, 0.0]
    x = (random(len(magnitudes), 96, seed=12) * torch.tensor(magnitudes)[:, None]).half()
    reference = _reference(x, values, scales)
    for tiles in (Tiles(16, 32, 64, 4, 1), Tiles(16, 32, 64, 4, 1, swap_ab=True)):
        out = mxfp8_kernels.mxfp8_linear(x, values, mxfp8.block_major(scales), tiles)
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        for row, magnitude in enumerate(magnitudes):
            if magnitude == 0.0:
                assert torch.equal(out[row], torch.zeros_like(out[row]))
            else:
                assert relative_error(out[row], reference[row]) < 4e-3, (row, magnitude)


def test_mma_tiles_run_groups_with_split_k_and_fewer_rows_than_groups() -> None:
    """Two rows over eight groups, both in the last groups (the grid has min(groups, rows) extra row blocks), and
    a K split."""
    groups, n, k = 8, 40, 192
    values, scales = mxfp8.quantize(random(groups, n, k, seed=13, scale=0.1))
    ends = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2], dtype=torch.int32)
    x = random(2, k, seed=14).half()
    plain = Tiles(16, 32, 64, 4, 1)
    for tiles in (plain, dataclasses.replace(plain, split_k=3), dataclasses.replace(plain, swap_ab=True)):
        out = mxfp8_kernels.mxfp8_grouped_mm(x, values, mxfp8.block_major(scales), ends, tiles)
        for row, group in ((0, 6), (1, 7)):
            assert relative_error(out[row], _reference(x[row : row + 1], values[group], scales[group])[0]) < 4e-3


def test_tiles_refuse_a_widening_the_kernel_lacks() -> None:
    with pytest.raises(ValueError, match="widen"):
        Tiles(16, 64, 128, 4, 4, widen=3)


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),
    [
        (1, 96, 128, GEMV),  # K over two steps
        (2, 40, 96, GEMV),  # N and K past a step's edge (K not a multiple of the step)
        (3, 64, 256, dataclasses.replace(GEMV, split_k=3)),  # split K, uneven split
        (1, 48, 1024, Tiles(1, 32, 512, 4, 1)),  # the H200's 512-input step
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_the_dequantized_reference(rows: int, n: int, k: int, tiles: Tiles, dtype: torch.dtype) -> None:
    """The CUDA-core kernel (one row a program, float32 math) within its output dtype's rounding of the float64
    product, rows of very different magnitudes included (no fp16 range to fit: bf16 rows of 2 ** 40 stay finite)."""
    values, scales = mxfp8.quantize(random(n, k, seed=rows + k, scale=0.05))
    # bf16 rows far outside fp16's range; fp16 rows whose outputs stay clear of fp16's subnormals
    magnitudes = [2.0**40, 2.0**-40, 1.0] if dtype == torch.bfloat16 else [300.0, 2.0**-6, 1.0]
    magnitude = torch.tensor(magnitudes)[:rows, None]
    x = (random(rows, k, seed=rows + 1) * magnitude).to(dtype)
    out = mxfp8_kernels.mxfp8_linear(x, values, mxfp8.block_major(scales), tiles)
    reference = _reference(x, values, scales)
    assert out.shape == (rows, n) and out.dtype == dtype
    for row in range(rows):
        assert relative_error(out[row], reference[row]) < (5e-3 if dtype == torch.bfloat16 else 1e-3), row


def test_steps_of_a_few_rows_take_the_gemv_and_larger_ones_the_mma_tiles() -> None:
    assert mxfp8_kernels.choose_tiles(1, 1).gemv and mxfp8_kernels.choose_tiles(2, 1).gemv
    assert not mxfp8_kernels.choose_tiles(3, 1).gemv  # rounds up to 4 rows, as its padded graph batch
    assert mxfp8_kernels.choose_tiles(8, 128).gemv and mxfp8_kernels.choose_tiles(64, 128).gemv
    assert mxfp8_kernels.choose_tiles(65, 128) == mxfp8_kernels.DECODE_TILES
    assert mxfp8_kernels.choose_tiles(16, 1) == mxfp8_kernels.DECODE_TILES
    assert mxfp8_kernels.choose_tiles(17, 1) == mxfp8_kernels.choose_tiles(64, 1) == mxfp8_kernels.DENSE_MEDIUM_TILES
    assert mxfp8_kernels.choose_tiles(4096, 128) == mxfp8_kernels.MEDIUM_TILES  # 32 rows an expert
    assert mxfp8_kernels.choose_tiles(65, 1) == mxfp8_kernels.choose_tiles(16384, 128) == mxfp8_kernels.PREFILL_TILES
    # no more pairs than experts routed over: 16 experts take the GEMV up to 16 pairs; under expert parallelism
    # (16 of 128 experts on this rank, the rows every rank's pairs) it follows the 128
    assert mxfp8_kernels.choose_tiles(16, 16).gemv and not mxfp8_kernels.choose_tiles(17, 16).gemv
    assert mxfp8_kernels.choose_tiles(64, 16, routed_experts=128).gemv
    # past the GEMV, tiles by the rows an expert gets: 512 pairs over 128 experts are 4 an expert, also when this
    # rank holds 16 of them
    assert mxfp8_kernels.choose_tiles(512, 16, routed_experts=128) == mxfp8_kernels.DECODE_TILES
    assert mxfp8_kernels.choose_tiles(512, 16) == mxfp8_kernels.MEDIUM_TILES


def test_split_k_launches_leave_their_counters_at_zero_for_the_next() -> None:
    """The last program of each tile sums the splits and sets the tile's counter back to 0: the same launch three
    times, and another split count after it, give the reference each time and leave every counter at 0."""
    values, scales = mxfp8.quantize(random(96, 256, seed=15, scale=0.05))
    x = random(3, 256, seed=16).half()
    reference = _reference(x, values, scales)
    outputs = []
    for split in (4, 4, 4, 2):
        tiles = Tiles(16, 32, 32, 4, 1, split_k=split)
        assert mxfp8_kernels.plan_launch(3, 96, 256, None, torch.device("cpu"), tiles).split == split
        outputs.append(mxfp8_kernels.mxfp8_linear(x, values, mxfp8.block_major(scales), tiles))
        assert relative_error(outputs[-1], reference) < 2e-3
        assert not mxfp8_kernels.split_counters(torch.device("cpu"), 3).any()
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])


def test_grouped_kernel_checks_its_arguments() -> None:
    values, row_major = mxfp8.quantize(random(2, 32, 64, seed=5))
    scales = mxfp8.block_major(row_major)
    x = random(4, 64, seed=6).half()
    with pytest.raises(ValueError, match="one end row per group"):
        mxfp8_kernels.mxfp8_grouped_mm(x, values, scales, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mxfp8_kernels.mxfp8_linear(x.float(), values[0], scales[0])
    with pytest.raises(ValueError, match="do not fit"):
        mxfp8_kernels.mxfp8_linear(x, values[0], scales[0][:, :1])
    # The checkpoint's row-major scales are a layout the kernels do not read (the model stores them block-major).
    with pytest.raises(ValueError, match="block-major"):
        mxfp8_kernels.mxfp8_linear(x, values[0], row_major[0])
    with pytest.raises(ValueError, match="block-major"):
        mxfp8_kernels.dequantize_groups(values, row_major, torch.empty(2, 32, 64, dtype=torch.bfloat16))


def test_block_major_scales_keep_shape_and_values() -> None:
    _, scales = mxfp8.quantize(random(3, 40, 96, seed=8))
    stored = mxfp8.block_major(scales)
    assert stored.shape == (3, 40, 3) and stored.stride() == (120, 1, 40) and torch.equal(stored, scales)
    empty = mxfp8.empty_scales((3, 40, 96), "cpu")
    assert empty.shape == scales.shape and empty.stride() == stored.stride() and empty.dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_groups_writes_the_exact_weights(dtype: torch.dtype) -> None:
    # N past a 64-row tile, K past a 256-input tile: masked edges in both directions.
    values, scales = mxfp8.quantize(random(3, 70, 288, seed=9, scale=0.3))
    out = torch.full((3, 70, 288), float("nan"), dtype=dtype)
    mxfp8_kernels.dequantize_groups(values, mxfp8.block_major(scales), out)
    assert torch.equal(out, mxfp8.dequantize(values, scales, dtype))
    # one matrix into a new tensor (dense linears past the kernel's rows)
    matrix = mxfp8_kernels.dequantize_matrix(values[1], mxfp8.block_major(scales)[1], dtype)
    assert matrix.dtype == dtype and torch.equal(matrix, out[1])


@triton.jit
def _widen_kernel(w_ptr, s_ptr, out_ptr, WIDEN: tl.constexpr):  # noqa: N803 (a Triton constexpr)
    rows = tl.arange(0, 64)[:, None]
    cols = tl.arange(0, 16)[None, :]
    w = tl.load(w_ptr + rows * 16 + cols)
    s = tl.load(s_ptr + (rows // 32) * 16 + cols)
    tl.store(out_ptr + rows * 16 + cols, mxfp8_kernels._widen(w, s, tl.bfloat16, WIDEN))


def test_widening_gives_the_exact_scaled_value_in_bf16() -> None:
    """A [K=64, N=16] tile as the kernel holds it: two 32-element blocks per column."""
    values, scales = mxfp8.quantize(random(16, 64, seed=7, scale=3.0))
    out = torch.empty(64, 16, dtype=torch.bfloat16)
    _widen_kernel[(1,)](values.T.contiguous(), scales.T.contiguous(), out, WIDEN=0)
    assert torch.equal(out.float(), mxfp8.dequantize(values, scales).T)


def _mxfp8_matmuls(text: TextConfig, tp: int, ep: bool) -> list[tuple[int, int, int, int | None]]:
    """``(rows per token, N, K, groups)`` of every MXFP8 matmul one rank of ``text`` runs per token (groups None:
    a dense linear), at tensor parallelism ``tp``, experts sharded whole (``ep``) or by rows."""
    heads, kv = text.num_heads * text.head_dim // tp, text.num_kv_heads * text.head_dim // min(tp, text.num_kv_heads)
    dense, shared = text.dense_intermediate_size // tp, text.shared_intermediate_size // tp
    experts, inter = (text.num_experts // tp, text.moe_intermediate_size) if ep else (
        text.num_experts, text.moe_intermediate_size // tp)  # fmt: skip
    hidden, top_k = text.hidden_size, text.num_experts_per_tok
    linears = [(heads, hidden), (2 * kv, hidden), (hidden, heads), (2 * dense, hidden), (hidden, dense),
               (2 * shared, hidden), (hidden, shared)]  # fmt: skip
    grouped = [(top_k, 2 * inter, hidden, experts), (top_k, hidden, inter, experts)]
    return [(1, n, k, None) for n, k in linears] + grouped


def test_a_padded_graph_batch_plans_every_matmul_as_the_eager_batch_it_pads() -> None:
    """A decode step of R requests replays the graph of the next captured size: its rows are bitwise the eager
    step's only if every MXFP8 launch picks the same tiles and K split for both (a row's result depends on those and
    its own inputs alone).  M3 (its top-4 default and top-8) at TP 1-8, experts by rows or whole, and the tiny
    model, for every batch up to 256 requests; planned for an H200's 132 SMs (``DEFAULT_SMS``)."""
    m3 = parse_config({"model_type": "minimax_m3_vl", "text_config": {}}).text
    tiny = parse_config(json.loads((ensure_tiny_checkpoint() / "config.json").read_text())).text
    configs = {"M3": m3, "M3 top-8": dataclasses.replace(m3, num_experts_per_tok=8), "tiny": tiny}
    sizes = capture_sizes(256)
    cpu = torch.device("cpu")
    differing = []
    for (name, text), tp, ep in itertools.product(configs.items(), (1, 2, 4, 8), (False, True)):
        if text.num_experts % tp or text.moe_intermediate_size // tp % 32 or text.num_kv_heads % min(tp, 4):
            continue
        for rows_per_token, n, k, groups in _mxfp8_matmuls(text, tp, ep):
            routed = text.num_experts if groups else None  # the MoE plans by the experts its tokens route over
            for requests in range(1, sizes[-1] + 1):
                padded = next(size for size in sizes if size >= requests)
                eager = mxfp8_kernels.plan_launch(requests * rows_per_token, n, k, groups, cpu, routed_experts=routed)
                if (
                    mxfp8_kernels.plan_launch(padded * rows_per_token, n, k, groups, cpu, routed_experts=routed)
                    != eager
                ):
                    differing.append((name, tp, ep, n, k, groups, requests))
    assert not differing
