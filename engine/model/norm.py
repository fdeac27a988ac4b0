"""Gemma-style RMSNorm, M3's only text norm: normalize in float32, scale by ``1 + weight``, cast back."""

import torch
from torch import nn

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
        return gemma_rms_norm(x, self.weight, self.eps)
