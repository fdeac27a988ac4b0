"""Vision -> language projector: a GELU MLP per patch, then a GELU MLP over each 2x2 block of patches.

Each patch goes to the text width, ``spatial_merge_size**2`` consecutive patches (one merge block, in the
processor's order) are concatenated along channels and fused into one language-model token.
"""

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model.params import Linear


class Projector(nn.Module):
    def __init__(
        self,
        vision_width: int,
        inner: int,
        text_width: int,
        merge_unit: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.merge_unit = merge_unit
        args = {"bias": True, "dtype": dtype, "device": device}
        self.linear_1 = Linear(vision_width, inner, **args)
        self.linear_2 = Linear(inner, text_width, **args)
        self.merge_linear_1 = Linear(text_width * merge_unit, inner, **args)
        self.merge_linear_2 = Linear(inner, text_width, **args)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[N, vision_width]`` -> ``[N / merge_unit, text_width]``."""
        x = self.linear_2(F.gelu(self.linear_1(patches)))
        x = x.reshape(x.shape[0] // self.merge_unit, -1)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))
