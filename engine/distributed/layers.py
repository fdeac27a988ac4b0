"""The model's parallel pieces: partial sums completed by an all-reduce, sharded MoE, the vocab-parallel LM head.

Each subclass keeps its parent's parameter names, so a rank's model has exactly the single-GPU model's
parameter paths at smaller shapes, and the checkpoint table (``engine.model.weights``) still says where every
tensor goes.
"""

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.model.attention import Attention
from m3stack.engine.model.config import TextConfig
from m3stack.engine.model.mlp import GatedMLP
from m3stack.engine.model.moe import Finish, MoE, Router
from m3stack.engine.model.params import empty_parameter


class ReducedAttention(Attention):
    """This rank's heads; ``o_proj`` holds their columns, so the outputs of all ranks sum to the full layer's."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        out = super().forward(x, cos, sin, backend)
        dist.all_reduce(out)
        return out


class ReducedGatedMLP(GatedMLP):
    """This rank's intermediate rows of a dense MLP (gate|up rows, down columns)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


class ShardedMoE(MoE):
    """The replicated router, this rank's experts (or slice of every expert) and slice of the shared expert.

    The routed and shared partial sums are added before the one all-reduce of the layer.  With expert
    parallelism a rank runs only the (token, slot) pairs routed to its experts; the others contribute zero
    (slots summed in order, so the result does not depend on which rank holds which expert).
    """

    def __init__(
        self,
        text: TextConfig,
        *,
        experts: range,
        expert_rows: int,
        shared_rows: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        local = _moe_text(text, len(experts), expert_rows, shared_rows)
        super().__init__(local, dtype=dtype, device=device)
        self.router = Router(text, dtype=dtype, device=device)  # scores over every expert, on every rank
        self.experts = experts
        self.all_experts = len(experts) == text.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out

    def _experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, finish: Finish | None = None
    ) -> torch.Tensor:
        if self.all_experts:
            return super()._experts(x, expert_ids, weights, finish)
        # Pairs routed to another rank's experts take the skip id: they sort after this rank's, run no GEMM and
        # add zero.  All on the device: no host sync, so decode steps replay CUDA graphs.  Gathering only this
        # rank's pairs instead (one sync) moves less memory but was 1.2-1.6x slower at every step size measured
        # (bench/moe_routing.py): the combine reads the sorted rows in place either way.
        local = (expert_ids >= self.experts.start) & (expert_ids < self.experts.stop)
        local_ids = torch.where(local, expert_ids - self.experts.start, len(self.experts))
        return super()._experts(x, local_ids, weights, finish)


def _moe_text(text: TextConfig, num_experts: int, expert_rows: int, shared_rows: int) -> TextConfig:
    return replace(
        text, num_experts=num_experts, moe_intermediate_size=expert_rows, shared_intermediate_size=shared_rows
    )


class VocabParallelLMHead(nn.Module):
    """Rows ``vocab`` of the LM head; the float32 logit slices are gathered on rank 0 in vocabulary order.

    Every rank's slice is padded to ``shard`` columns (only trailing ranks are short, so the padding lands past
    the vocabulary and is cut).  Rank 0 returns ``[n, vocab_size]``; the other ranks return their own slice.
    """

    def __init__(
        self,
        hidden: int,
        vocab: range,
        shard: int,
        vocab_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.weight = empty_parameter(len(vocab), hidden, dtype=dtype, device=device)
        self.shard = shard
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.pad(F.linear(hidden, self.weight).float(), (0, self.shard - self.weight.shape[0]))
        if dist.get_rank() != 0:
            dist.gather(local, None, dst=0)
            return local
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.gather(local, pieces, dst=0)
        return torch.cat(pieces, dim=-1)[:, : self.vocab_size]
