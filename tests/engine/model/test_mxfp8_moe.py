"""The MoE's large-step MXFP8 path on CPU (Triton interpreted): experts widened into a bf16 scratch a chunk at a time
and multiplied by torch's grouped GEMM give each expert's SwiGLU-OAI MLP of the dequantized weights."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.model import mxfp8
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.mlp import swiglu_oai
from m3stack.engine.model.moe import MoE

TEXT = parse_config({"model_type": "minimax_m3_vl", "text_config": {
    "hidden_size": 64, "intermediate_size": 32, "shared_intermediate_size": 32, "num_local_experts": 6,
    "num_experts_per_tok": 2, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32}}).text  # fmt: skip
EXPERTS = ("gate_up_proj", "down_proj")


def quantized_layer(seed: int) -> MoE:
    """A bf16 MoE whose expert stacks are MXFP8 (random weights, blocks of different magnitudes), on CPU."""
    layer = MoE(TEXT, dtype=torch.bfloat16, device="meta")
    mxfp8.quantize_parameters(layer, EXPERTS)
    layer.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in EXPERTS:
            weights = getattr(layer, name)
            gains = torch.exp2(torch.randint(-3, 3, (*weights.shape[:-1], weights.shape[-1] // 32, 1),
                                             generator=generator)).repeat_interleave(32, -1)  # fmt: skip
            values, scales = mxfp8.quantize(torch.randn(weights.shape, generator=generator) * gains.view(weights.shape))
            weights.copy_(values)
            getattr(layer, name + "_scale_inv").copy_(scales)
    return layer


def expert_mlp(layer: MoE, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """One expert's MLP of the dequantized weights, in float64."""
    gate_up = mxfp8.dequantize(layer.gate_up_proj[expert], layer.gate_up_proj_scale_inv[expert]).double()
    down = mxfp8.dequantize(layer.down_proj[expert], layer.down_proj_scale_inv[expert]).double()
    return swiglu_oai(rows.double() @ gate_up.T, layer.alpha, layer.limit) @ down.T


@pytest.mark.parametrize("scratch_experts", [1, 2, 6])
def test_chunks_of_dequantized_experts_give_each_experts_mlp(monkeypatch, scratch_experts: int) -> None:
    layer = quantized_layer(seed=scratch_experts)
    expert_bytes = (layer.gate_up_proj[0].numel() + layer.down_proj[0].numel()) * 2  # bf16
    monkeypatch.setattr(mxfp8, "DEQUANTIZE_SCRATCH_BYTES", 2 * scratch_experts * expert_bytes)
    counts = [5, 0, 0, 17, 1, 9]  # empty experts (a chunk with no rows when 2 a chunk), one past a chunk's edge
    skipped = 3  # pairs of another rank's experts, after the last end: left unwritten
    x = torch.randn(sum(counts) + skipped, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = layer.grouped_dequantized(x, ends)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], 64)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            reference = expert_mlp(layer, expert, x[rows])
            error = (out[rows].double() - reference).norm() / reference.norm()
            assert error < 1e-2, f"expert {expert}: relative error {error:.2e}"  # bf16 products and sums
        start += count
