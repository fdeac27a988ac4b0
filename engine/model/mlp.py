"""M3's gated MLP: SwiGLU-OAI (clamped gate and up, sigmoid gain alpha, ``up + 1``) over a fused gate|up projection."""

import torch
from torch import nn

from m3stack.engine.model import fused
from m3stack.engine.model.params import Linear


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[..., 2I] -> [..., I]``: gate is the first half, up the second (not interleaved as in GPT-OSS).

    One fused kernel on CUDA tensors (``model.fused``)."""
    if gate_up.is_cuda:
        return fused.swiglu_oai(gate_up, alpha, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1.0) * glu


class GatedMLP(nn.Module):
    """The dense MLP of ``dense`` layers and the shared expert of MoE layers."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        alpha: float,
        limit: float,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))
