"""M3's MoE block: sigmoid router with a selection-only correction bias, top-k experts, a shared expert.

Per token: ``s = sigmoid(W_r x)`` (float32); experts are chosen by ``s + e_score_correction_bias`` but weighted by
``s`` renormalized over the chosen k; the routed sum is multiplied by ``routed_scaling_factor`` and the shared
expert's output is added.  Experts are SwiGLU-OAI MLPs whose weights are stacked ``[E, ...]``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from m3stack.engine.model.config import TextConfig
from m3stack.engine.model.mlp import GatedMLP, swiglu_oai
from m3stack.engine.model.params import empty_parameter


class Router(nn.Module):
    def __init__(self, text: TextConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.top_k = text.num_experts_per_tok
        self.weight = empty_parameter(text.num_experts, text.hidden_size, dtype=dtype, device=device)
        # Kept in float32 whatever the model dtype: it only shifts sigmoid scores, which are float32.
        self.correction_bias = empty_parameter(text.num_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids ``[T, k]`` int64 and their weights ``[T, k]`` float32."""
        scores = torch.sigmoid(F.linear(x, self.weight).float())
        chosen = torch.topk(scores + self.correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / weights.sum(dim=-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, text: TextConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        experts, hidden, inter = text.num_experts, text.hidden_size, text.moe_intermediate_size
        self.alpha, self.limit = text.swiglu_alpha, text.swiglu_limit
        self.routed_scaling_factor = text.routed_scaling_factor
        self.router = Router(text, dtype=dtype, device=device)
        self.gate_up_proj = empty_parameter(experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = empty_parameter(experts, hidden, inter, dtype=dtype, device=device)
        self.shared_expert = GatedMLP(
            hidden, text.shared_intermediate_size, alpha=self.alpha, limit=self.limit, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        expert_ids, weights = self.router(x)
        routed = self._experts(x, expert_ids, weights)
        return (routed * self.routed_scaling_factor).to(x.dtype) + shared

    def _experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's chosen experts, float32 ``[T, H]``.

        Token-expert pairs are sorted by expert so each expert runs one GEMM over its tokens.  The per-expert
        counts go to the host (one sync per layer); a grouped-GEMM kernel would remove it.
        """
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of_pair = order // top_k
        pair_weights = weights.flatten()[order]
        inputs = x[token_of_pair]
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            hidden = swiglu_oai(F.linear(inputs[rows], self.gate_up_proj[expert]), self.alpha, self.limit)
            expert_out = F.linear(hidden, self.down_proj[expert]).float() * pair_weights[rows, None]
            out.index_add_(0, token_of_pair[rows], expert_out)
            start += count
        return out
