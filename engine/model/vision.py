"""M3's vision tower: linear patch embedding, pre-norm, CLIP-style encoder layers with 3D axial RoPE.

Input is what the M3 processor emits: flattened patches ``[N, C * Tp * P * P]`` of one or more images / video
chunks, concatenated, with ``grid_thw`` ``[n, 3]`` (patches along t, h, w per item).  Within an item, patches come
in 2x2 merge-block order (``spatial_merge_size`` = 2), so every ``merge_size**2`` consecutive rows form one
language-model token after the projector.  Attention is bidirectional within an item (all of a video chunk's
frames see each other) and never across items.

``normalize_patches`` turns uint8 patches (the gateway's compact wire format) into the floats the processor
would have produced, with the checkpoint's mean/std.
"""

import enum

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model.config import PixelNormalization, VisionConfig
from m3stack.engine.model.params import LayerNorm, Linear, empty_parameter
from m3stack.engine.model.rope import apply_rotary, inverse_frequencies, vision_cos_sin


class Modality(enum.StrEnum):
    IMAGE = "image"
    VIDEO = "video"


def normalize_patches(patches: torch.Tensor, norm: PixelNormalization) -> torch.Tensor:
    """uint8 patches ``[N, C * rest]`` (channel-major inside a patch) -> float32 ``(x * rescale - mean) / std``."""
    channels = len(norm.mean)
    if patches.shape[1] % channels:
        raise ValueError(f"patch length {patches.shape[1]} is not a multiple of {channels} channels")
    # The HF processor folds the rescale into mean and std: (x - mean / r) / (std / r).
    mean = torch.tensor(norm.mean, device=patches.device) * (1.0 / norm.rescale_factor)
    std = torch.tensor(norm.std, device=patches.device) * (1.0 / norm.rescale_factor)
    pixels = patches.float().view(patches.shape[0], channels, -1)
    return ((pixels - mean[:, None]) / std[:, None]).view(patches.shape[0], -1)


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' ACT2FN semantics for the names in ``config.VISION_ACTIVATIONS``."""
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported vision activation {name!r}")


def check_grid(grid_thw: torch.Tensor, num_patches: int, merge_size: int) -> list[tuple[int, int, int]]:
    """``grid_thw`` as host tuples, after checking it describes exactly ``num_patches`` mergeable patches."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"grid_thw must have shape [n, 3] with n >= 1, got {tuple(grid_thw.shape)}")
    grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for t, h, w in grid:
        if t <= 0 or h <= 0 or w <= 0 or h % merge_size or w % merge_size:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) needs positive sizes with h, w multiples of {merge_size}")
    total = sum(t * h * w for t, h, w in grid)
    if total != num_patches:
        raise ValueError(f"grid_thw describes {total} patches but pixel_values has {num_patches} rows")
    return grid


def patch_positions(grid: list[tuple[int, int, int]], merge_size: int, device: torch.device) -> torch.Tensor:
    """``[N, 3]`` (t, h, w) coordinates of every patch, h/w enumerated in merge-block order."""
    out = []
    for t, h, w in grid:
        hpos = torch.arange(h, device=device)[:, None].expand(h, w)
        wpos = torch.arange(w, device=device)[None, :].expand(h, w)
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        hpos = hpos.reshape(blocks).transpose(1, 2).flatten().repeat(t)
        wpos = wpos.reshape(blocks).transpose(1, 2).flatten().repeat(t)
        tpos = torch.arange(t, device=device).repeat_interleave(h * w)
        out.append(torch.stack([tpos, hpos, wpos], dim=-1))
    return torch.cat(out)


class VisionLayer(nn.Module):
    def __init__(self, vision: VisionConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        width = vision.hidden_size
        self.num_heads, self.head_dim = vision.num_heads, vision.head_dim
        args = {"dtype": dtype, "device": device}
        self.layer_norm1 = LayerNorm(width, vision.layer_norm_eps, **args)
        self.qkv = Linear(width, 3 * width, bias=True, **args)
        self.out_proj = Linear(width, width, bias=True, **args)
        self.layer_norm2 = LayerNorm(width, vision.layer_norm_eps, **args)
        self.fc1 = Linear(width, vision.intermediate_size, bias=True, **args)
        self.fc2 = Linear(vision.intermediate_size, width, bias=True, **args)
        self.activation = vision.hidden_act

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        num = x.shape[0]
        q, k, v = self.qkv(self.layer_norm1(x)).view(num, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        outputs = []
        for q_i, k_i, v_i in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            heads_first = [t.transpose(0, 1) for t in (q_i, k_i, v_i)]
            outputs.append(F.scaled_dot_product_attention(*heads_first).transpose(0, 1))
        x = x + self.out_proj(torch.cat(outputs).reshape(num, -1))
        return x + self.fc2(activate(self.fc1(self.layer_norm2(x)), self.activation))


class VisionTower(nn.Module):
    def __init__(self, vision: VisionConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = vision
        patch = (vision.num_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.patch_embed = nn.Module()
        # Kept in the checkpoint's Conv3d shape; stride = kernel makes it a linear map of each flattened patch.
        self.patch_embed.weight = empty_parameter(vision.hidden_size, *patch, dtype=dtype, device=device)
        self.pre_norm = LayerNorm(vision.hidden_size, vision.layer_norm_eps, dtype=dtype, device=device)
        self.layers = nn.ModuleList(VisionLayer(vision, dtype=dtype, device=device) for _ in range(vision.num_layers))
        self.register_buffer(
            "inv_freq", inverse_frequencies(vision.rotary_axis_dim, vision.rope_theta).to(device), persistent=False
        )

    def forward(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """Float patches ``[N, patch_dim]`` and their (checked) grid -> patch features ``[N, vision hidden]``."""
        weight = self.patch_embed.weight
        x = F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))
        positions = patch_positions(grid, self.config.spatial_merge_size, x.device)
        cos, sin = vision_cos_sin(positions, self.inv_freq, x.dtype)
        x = self.pre_norm(x)
        lengths = [t * h * w for t, h, w in grid]
        for layer in self.layers:
            x = layer(x, cos, sin, lengths)
        return x
