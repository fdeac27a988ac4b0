"""MXFP8 on the H200: the Triton kernels against bf16 on random M3-shaped weights, the MoE under CUDA graphs,
and the tiny MXFP8 model in bf16 within the bounds the bf16 path meets.

Kernels: against the float32 product of the dequantized weights, our error within 1.5x of cuBLAS's bf16 GEMM (or
torch's bf16 grouped GEMM) on the same dequantized bf16 weights, for each way of widening the weights.
Model: the tiny checkpoint's MXFP8 copy in bf16 (Triton kernels) and the bf16 model of its dequantized weights
(cuBLAS) against the float32 model of those weights: per-token logit errors distributed alike (median and 90th
percentile within 1.5x + 5e-3, the bar test_model_bf16.py sets against transformers' bf16) and greedy tokens the
float32 model agrees with as often.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.model import mxfp8, mxfp8_kernels
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.loader import load_model
from m3stack.engine.model.moe import MoE, grouped_mm
from m3stack.engine.model.mxfp8_kernels import (
    DECODE_TILES,
    DENSE_MEDIUM_TILES,
    GEMV_TILES,
    GROUPED_GEMV_TILES,
    MEDIUM_TILES,
    PREFILL_TILES,
    Tiles,
)
from m3stack.engine.model.mxfp8_writer import write_dequantized_copy, write_mxfp8_copy
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.engine.side_stream import side_stream
from tests.engine.model.hf_oracle import token_errors
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

HIDDEN, INTER = 6144, 3072
# (shape or tokens, tiles): the GEMV (decode's default up to a few rows), every MMA tile class of the plan (widening
# through float32), the other widenings and swap_ab once each.
DENSE_CASES = [((1, 2 * INTER, HIDDEN), GEMV_TILES), ((2, HIDDEN, INTER), GEMV_TILES),
               ((1, 2 * INTER, HIDDEN), DECODE_TILES), ((16, HIDDEN, INTER), DECODE_TILES),
               ((300, 1024, HIDDEN), PREFILL_TILES),
               ((64, HIDDEN, INTER), DENSE_MEDIUM_TILES), ((37, 2 * INTER, HIDDEN), DENSE_MEDIUM_TILES),
               ((16, HIDDEN, INTER), dataclasses.replace(DECODE_TILES, widen=1)),
               ((300, 1024, HIDDEN), dataclasses.replace(PREFILL_TILES, widen=2)),
               ((16, HIDDEN, INTER), dataclasses.replace(DECODE_TILES, swap_ab=True)),
               ((64, 2 * INTER, HIDDEN), dataclasses.replace(MEDIUM_TILES, swap_ab=True))]  # fmt: skip
GROUPED_CASES = [(1, GROUPED_GEMV_TILES), (4, GROUPED_GEMV_TILES), (4, GEMV_TILES), (1, DECODE_TILES),
                 (64, DECODE_TILES), (512, MEDIUM_TILES),
                 (2048, PREFILL_TILES),
                 (64, dataclasses.replace(DECODE_TILES, widen=1)),
                 (2048, dataclasses.replace(PREFILL_TILES, widen=2)),
                 (64, dataclasses.replace(DECODE_TILES, swap_ab=True))]  # fmt: skip


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def _weights(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP8 weights (fresh each call, blocks of very different magnitudes) and their bf16 dequantization."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(shape, generator=generator, device="cuda") / shape[-1] ** 0.5
    weight *= torch.exp2(torch.randint(-6, 6, (*shape[:-1], shape[-1] // 32, 1), generator=generator,
                                       device="cuda")).repeat_interleave(32, -1).view(shape)  # fmt: skip
    values, scales = mxfp8.quantize(weight)
    return values, mxfp8.block_major(scales), mxfp8.dequantize(values, scales, torch.bfloat16)


@pytest.mark.parametrize(("shape", "tiles"), DENSE_CASES)
def test_dense_kernel_is_as_accurate_as_cublas(shape: tuple[int, int, int], tiles: Tiles) -> None:
    rows, n, k = shape
    values, scales, dense = _weights(n, k, seed=rows)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    reference = x.float() @ dense.float().T
    ours = mxfp8_kernels.mxfp8_linear(x, values, scales, tiles)
    assert ours.dtype == torch.bfloat16 and not ours.isnan().any()
    assert _error(ours, reference) <= 1.5 * _error(torch.nn.functional.linear(x, dense), reference) + 1e-4


def test_split_k_launches_on_the_main_and_the_side_stream_overlap_without_sharing_counters() -> None:
    """The MoE's shared expert runs on the side stream while the routed experts run on the main one, both possibly
    splitting K: 50 pairs of split launches released together on both streams give the bits each gives alone."""
    values, scales, _ = _weights(HIDDEN, 8192, seed=22)
    x = torch.randn(1, 8192, device="cuda").to(torch.bfloat16)
    assert mxfp8_kernels.plan_launch(1, HIDDEN, 8192, None, x.device, DECODE_TILES).split > 1
    alone = mxfp8_kernels.mxfp8_linear(x, values, scales, DECODE_TILES)
    main, side = torch.cuda.current_stream(), side_stream(x.device)
    outputs = []
    for _ in range(50):
        side.wait_stream(main)
        torch.cuda._sleep(1_000_000)  # both streams' launches queue behind these and start together
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000)
            on_side = mxfp8_kernels.mxfp8_linear(x, values, scales, DECODE_TILES)
        on_main = mxfp8_kernels.mxfp8_linear(x, values, scales, DECODE_TILES)
        main.wait_stream(side)
        outputs += [on_side, on_main]
    assert all(torch.equal(out, alone) for out in outputs)


@pytest.mark.parametrize("tiles", [DECODE_TILES, DENSE_MEDIUM_TILES, PREFILL_TILES])
def test_bf16_rows_of_any_magnitude_keep_their_accuracy(tiles: Tiles) -> None:
    """bf16 rows 2 ** 40 and 2 ** -40 times the others and a zero row, through each MMA tile class: each row within
    the bf16 product's error of the reference (nothing passes through a narrower range)."""
    values, scales, dense = _weights(256, INTER, seed=9)
    magnitudes = [1.0, 2.0**40, 2.0**-40, 0.0, 300.0]
    x = torch.randn(len(magnitudes), INTER, device="cuda") * torch.tensor(magnitudes, device="cuda")[:, None]
    x = x.to(torch.bfloat16)
    out = mxfp8_kernels.mxfp8_linear(x, values, scales, tiles)
    reference = x.double() @ dense.double().T
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    for row in (0, 1, 2, 4):
        assert _error(out[row], reference[row]) < 4e-3, row


def test_dense_linears_of_prefill_size_widen_the_weight_and_give_cublas_bits() -> None:
    """Past ``DENSE_KERNEL_MAX_ROWS`` rows ``mxfp8.linear`` widens the weight (exactly) and calls cuBLAS: the bf16
    product of the dequantized weight, bit for bit; a row fewer runs the kernel, as accurate as cuBLAS."""
    values, scales, dense = _weights(HIDDEN, INTER, seed=5)
    rows = mxfp8.DENSE_KERNEL_MAX_ROWS + 1
    x = torch.randn(rows, INTER, device="cuda").to(torch.bfloat16)
    assert torch.equal(mxfp8.linear(x, values, scales, None), torch.nn.functional.linear(x, dense))
    below = x[: rows - 1]
    reference = below.float() @ dense.float().T
    ours = mxfp8.linear(below, values, scales, None)
    assert _error(ours, reference) <= 1.5 * _error(torch.nn.functional.linear(below, dense), reference) + 1e-4


@pytest.mark.parametrize(("tokens", "tiles"), GROUPED_CASES)
def test_grouped_kernel_is_as_accurate_as_torch_grouped_mm(tokens: int, tiles: Tiles) -> None:
    experts, top_k = 32, 8  # 32 of M3's 128 experts: the shapes and the routing density, a quarter of the bytes
    values, scales, dense = _weights(experts, 2 * INTER, HIDDEN, seed=tokens)
    generator = torch.Generator(device="cuda").manual_seed(tokens + 1)
    ids = torch.randint(0, experts + 1, (tokens * top_k,), generator=generator, device="cuda").sort().values
    ends = torch.bincount(ids, minlength=experts + 1)[:experts].cumsum(0).to(torch.int32)  # id 32: skipped rows
    x = torch.randn(ids.numel(), HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
    ours = mxfp8_kernels.mxfp8_grouped_mm(x, values, scales, ends, tiles)
    peer = grouped_mm(x, dense.transpose(1, 2), ends)
    owned = int(ends[-1])
    reference = torch.cat([x[a:b].float() @ dense[e].float().T for e, (a, b) in enumerate(_spans(ends))])
    assert reference.shape[0] == owned
    assert _error(ours[:owned], reference) <= 1.5 * _error(peer[:owned], reference) + 1e-4


@pytest.mark.parametrize("tiles", [GEMV_TILES, DECODE_TILES, DENSE_MEDIUM_TILES])
def test_split_k_sums_in_the_last_program_bitwise_alike_eager_and_graph_replayed(tiles: Tiles) -> None:
    """M3's o projection at 1 row (K split, each tile's last program adding the partials), 200 eager launches and
    200 replays of a captured one: every output bitwise the first (a partial read before its writer finished would
    differ), the counters all back at 0."""
    values, scales, dense = _weights(HIDDEN, 8192, seed=21)
    x = torch.randn(1, 8192, device="cuda").to(torch.bfloat16)
    assert mxfp8_kernels.plan_launch(1, HIDDEN, 8192, None, x.device, tiles).split > 1
    first = mxfp8_kernels.mxfp8_linear(x, values, scales, tiles)
    assert _error(first, x.float() @ dense.float().T) < 1e-2
    eager = [mxfp8_kernels.mxfp8_linear(x, values, scales, tiles) for _ in range(200)]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        captured = mxfp8_kernels.mxfp8_linear(x, values, scales, tiles)
    replayed = []
    for _ in range(200):
        graph.replay()
        replayed.append(captured.clone())
    assert all(torch.equal(out, first) for out in eager + replayed)
    assert not mxfp8_kernels.split_counters(x.device, 1).any()


@pytest.mark.parametrize("tokens", [64, 2048])
def test_dequantized_experts_are_as_accurate_as_the_fused_kernel(tokens: int) -> None:
    """The MoE's large-step path (experts widened into a bf16 scratch on a side stream, torch's grouped GEMM) and
    its fused path against the float32 experts of the dequantized weights, on the same routed tokens."""
    text = parse_config({"model_type": "minimax_m3_vl", "text_config": {
        "hidden_size": HIDDEN, "intermediate_size": INTER, "shared_intermediate_size": INTER,
        "num_local_experts": 32, "num_experts_per_tok": 8}}).text  # fmt: skip
    layer = MoE(text, dtype=torch.bfloat16, device="meta")
    mxfp8.quantize_parameters(layer, ["gate_up_proj", "down_proj"])
    layer.to_empty(device="cuda")
    with torch.no_grad():
        for seed, name in enumerate(("gate_up_proj", "down_proj")):
            values, scales, _ = _weights(*getattr(layer, name).shape, seed=seed)
            getattr(layer, name).copy_(values)
            getattr(layer, name + "_scale_inv").copy_(scales)
        layer.router.weight.normal_(0, HIDDEN**-0.5)
        layer.router.correction_bias.zero_()
    x = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        ids, weights = layer.router(x)
        reference = layer._experts(x.float(), ids, weights)  # float32 (every expert over every row), dequantized
        outputs = {}
        for label, threshold in (("fused", math.inf), ("dequantized", 0.0)):
            layer.dequantize_from_rows = threshold
            outputs[label] = layer._experts(x, ids, weights)
    assert _error(outputs["dequantized"], reference) <= 1.5 * _error(outputs["fused"], reference) + 1e-4


def _spans(ends: torch.Tensor) -> list[tuple[int, int]]:
    bounds = [0, *ends.tolist()]
    return list(itertools.pairwise(bounds))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp8")
    quantized = write_mxfp8_copy(ensure_tiny_checkpoint(), root / "mxfp8")
    return quantized, write_dequantized_copy(quantized, root / "dequantized")


def _greedy(model, prompt: torch.Tensor, tokens: int = 24):
    with torch.inference_mode():
        return PagedRunner(model, 64, "cuda").greedy(Chunk(Sequence(), prompt.cuda(), None, None), tokens)


def test_bf16_mxfp8_model_is_as_accurate_as_the_bf16_model(checkpoints, exact_float32) -> None:
    quantized_dir, dequantized_dir = checkpoints
    prompt = torch.randint(0, 360, (200,), generator=torch.Generator().manual_seed(12))
    reference_logits, reference_tokens = _greedy(load_model(dequantized_dir, "cuda", torch.float32)[0], prompt)
    mxfp8_logits, mxfp8_tokens = _greedy(load_model(quantized_dir, "cuda", torch.bfloat16)[0], prompt)
    bf16_logits, bf16_tokens = _greedy(load_model(dequantized_dir, "cuda", torch.bfloat16)[0], prompt)
    ours, peer = token_errors(mxfp8_logits, reference_logits), token_errors(bf16_logits, reference_logits)
    for quantile in (0.5, 0.9):
        assert torch.quantile(ours, quantile) <= 1.5 * torch.quantile(peer, quantile) + 5e-3
    agree = sum(a == b for a, b in zip(mxfp8_tokens, reference_tokens, strict=True))
    peer_agree = sum(a == b for a, b in zip(bf16_tokens, reference_tokens, strict=True))
    assert agree >= peer_agree - 3


def test_the_engine_serves_the_mxfp8_copy_with_cuda_graphs(checkpoints) -> None:
    """Decode steps replayed from CUDA graphs (the grouped GEMM's ends on the device) give the eager steps' tokens."""
    quantized_dir, _ = checkpoints
    prompts = {f"r{i}": torch.randint(0, 360, (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate((150, 40, 260))}  # fmt: skip
    results = {}
    for graphs in (False, True):
        core = build_engine_core(EngineConfig(model=str(quantized_dir), device="cuda", dtype="bfloat16",
                                              num_kv_blocks=128, max_num_seqs=8, cuda_graphs=graphs))  # fmt: skip
        assert core.runner.model.layers[1].mlp.gate_up_proj.dtype == torch.float8_e4m3fn
        sampling = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
        requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
        results[graphs] = {rid: r.token_ids for rid, r in offline.generate(core, requests).items()}
    assert results[True] == results[False]
