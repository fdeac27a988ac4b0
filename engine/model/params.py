"""Parameter holders that allocate without initializing: a checkpoint overwrites every value anyway.

``torch.nn.Linear`` / ``Embedding`` would run a random init over every weight at construction (minutes of CPU
for a large MoE), so the serving model builds its weights with ``torch.empty`` on the target device instead.
Weights never need gradients here.  A ``Linear`` whose weight the checkpoint stores in MXFP8 holds it in FP8 with
its scales (``mxfp8.quantize_parameters``) and multiplies through ``mxfp8.linear``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model import mxfp8


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out_features, in_features]`` (the checkpoint layout)."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None  # MXFP8 scales, when the weight is stored so

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            return mxfp8.linear(x, self.weight, self.weight_scale_inv, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_parameter(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)
        self.bias = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
