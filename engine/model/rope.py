"""Rotary position embeddings: the text decoder's partial RoPE and the vision tower's 3D axial RoPE.

Both rotate the first ``R`` channels of each head in "rotate half" layout (channel ``i`` pairs with
``i + R/2``) and pass the rest through.  Angles are computed in float32 from the positions each step, then
cos/sin are cast to the activations' dtype, as the reference does.
"""

import torch


def inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32: ``theta ** (-2i / rotary_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def text_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, R]`` for token positions ``[T]``."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def vision_cos_sin(
    positions_thw: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[N, 6F]`` for patch coordinates ``[N, 3]`` (t, h, w): F frequencies per axis, axes concatenated."""
    freqs = (positions_thw[..., None].float() * inv_freq.to(positions_thw.device)).flatten(1)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by cos/sin ``[T, R]`` (R <= D) on its first R channels."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    rotated = rotated * cos + rotate_half * sin
    return torch.cat((rotated, passed), dim=-1)
