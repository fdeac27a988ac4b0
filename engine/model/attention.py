"""M3 self-attention for a flat varlen batch: projections, per-head q/k RMSNorm, partial RoPE, then the backend.

One fused projection produces q, k, v and, on MSA layers, the indexer's query (``index_n_heads`` heads) and its
single shared key head.  The indexer gets its own RMSNorm and the same RoPE angles (cos/sin cut to its head
width).  Storing keys into the paged cache and attending over it is the ``AttentionBackend``'s job.
"""

import torch
from torch import nn

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.model import fused
from m3stack.engine.model.config import TextConfig
from m3stack.engine.model.norm import GemmaRMSNorm
from m3stack.engine.model.params import Linear
from m3stack.engine.model.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, text: TextConfig, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer = layer
        self.sparse = text.sparse_layers[layer]
        self.num_heads, self.num_kv_heads, self.head_dim = text.num_heads, text.num_kv_heads, text.head_dim
        self.index_heads, self.index_head_dim = text.index_num_heads, text.index_head_dim
        self.split = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        if self.sparse:
            self.split += [self.index_heads * self.index_head_dim, self.index_head_dim]
        norm_args = {"eps": text.rms_norm_eps, "dtype": dtype, "device": device}
        self.in_proj = Linear(text.hidden_size, sum(self.split), bias=False, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(self.head_dim, **norm_args)
        self.k_norm = GemmaRMSNorm(self.head_dim, **norm_args)
        if self.sparse:
            self.index_q_norm = GemmaRMSNorm(self.index_head_dim, **norm_args)
            self.index_k_norm = GemmaRMSNorm(self.index_head_dim, **norm_args)
        self.o_proj = Linear(self.num_heads * self.head_dim, text.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``x`` ``[T, hidden]``, cos/sin ``[T, rotary_dim]`` -> ``[T, hidden]``."""
        num_tokens = x.shape[0]
        parts = self.in_proj(x).split(self.split, dim=-1)
        q = self._norm_rope(self.q_norm, parts[0].view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = self._norm_rope(self.k_norm, parts[1].view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = parts[2].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.sparse:
            index_cos, index_sin = cos[:, : self.index_head_dim], sin[:, : self.index_head_dim]
            index_q = parts[3].view(num_tokens, self.index_heads, self.index_head_dim)
            index_q = self._norm_rope(self.index_q_norm, index_q, index_cos, index_sin)
            index_k = parts[4].view(num_tokens, 1, self.index_head_dim)
            index_k = self._norm_rope(self.index_k_norm, index_k, index_cos, index_sin).view(
                num_tokens, self.index_head_dim
            )
            out = backend.sparse(self.layer, q, k, v, index_q, index_k)
        else:
            out = backend.dense(self.layer, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    @staticmethod
    def _norm_rope(norm: GemmaRMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm then partial RoPE of ``[T, H, D]``; one fused kernel on CUDA tensors."""
        if x.is_cuda:
            return fused.head_norm_rope(x, norm.weight, cos, sin, norm.eps)
        return apply_rotary(norm(x), cos, sin)
