"""Gemma-style RMSNorm, M3's only text norm: normalize in float32, scale by ``1 + weight``, cast back.

On CUDA tensors the norm (and the residual add before it) runs as one fused kernel (``model.fused``).
"""

import torch
from torch import nn

from m3stack.engine.model import fused
from m3stack.engine.model.params import empty_parameter


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dimension.  The checkpoint stores ``weight`` as the offset from 1."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    # Scale before the cast back (not after), as the reference does for half precisions.
    return (hidden * (1.0 + weight.float())).type_as(x)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fused.rms_norm(x, self.weight, self.eps)
        return gemma_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the decoder's residual stream, one kernel on the GPU."""
        if x.is_cuda:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return gemma_rms_norm(summed, self.weight, self.eps), summed
