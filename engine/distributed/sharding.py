"""Which part of the model one rank owns: pure arithmetic on the text config, checked once with clear errors.

* Attention: query heads split evenly.  KV heads split evenly while ``tp <= Hkv``; past that each KV head is
  replicated on ``tp / Hkv`` consecutive ranks (M3 at TP=8: 64 query heads, 4 KV heads -> 8 query heads and 1 KV
  head per rank, each KV head on 2 ranks), so a rank's query heads always use KV heads it holds.  The MSA index
  query heads are one per KV head and follow them, and so does the block selection; the index KEY is one shared
  head per token: its projection, its cache (``d`` = 128 values per token) and the block scores are replicated.
* Dense MLP and the shared expert: the intermediate rows split evenly (column-parallel gate|up, row-parallel
  down, one all-reduce).
* Routed experts: tensor-parallel (every expert's intermediate rows split) or, with ``--expert-parallel``,
  whole experts per rank; the router is replicated either way.
* Vocabulary: the LM head's rows split in ``ceil(V / tp)`` pieces (the last one shorter); the input embedding is
  replicated (one lookup, no collective).
"""

from dataclasses import dataclass, replace

from m3stack.engine.model.config import TextConfig


class ShardingError(ValueError):
    """The model cannot be split over this many ranks the way it is asked to."""


@dataclass(frozen=True)
class Span:
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _even(total: int, parts: int, index: int, what: str) -> Span:
    if total % parts:
        raise ShardingError(f"{what} ({total}) is not divisible by --tensor-parallel {parts}")
    size = total // parts
    return Span(index * size, (index + 1) * size)


@dataclass(frozen=True)
class ShardPlan:
    """The slices of rank ``rank`` of ``world`` (see the module docstring)."""

    rank: int
    world: int
    expert_parallel: bool
    q_heads: Span
    kv_heads: Span  # also the rank's MSA index query heads
    dense_rows: Span  # intermediate rows of dense MLP layers
    shared_rows: Span  # intermediate rows of the shared expert
    expert_rows: Span  # intermediate rows of every routed expert (all of them with expert parallelism)
    experts: Span  # routed experts held (all of them without expert parallelism)
    vocab: Span  # LM head rows
    vocab_shard: int  # ceil(V / world): every rank's logit slice is padded to this before the gather

    @property
    def is_leader(self) -> bool:
        """Rank 0 also holds the vision tower and the projector and samples."""
        return self.rank == 0

    def local_text(self, text: TextConfig) -> TextConfig:
        """The text config as this rank's attention sees it (its head counts)."""
        return replace(
            text,
            num_heads=self.q_heads.size,
            num_kv_heads=self.kv_heads.size,
            index_num_heads=self.kv_heads.size if any(text.sparse_layers) else text.index_num_heads,
        )


def plan_shards(text: TextConfig, world: int, rank: int, expert_parallel: bool) -> ShardPlan:
    """Rank ``rank``'s slices, or a ``ShardingError`` naming the dimension that does not divide."""
    if not 0 <= rank < world:
        raise ShardingError(f"rank {rank} is not in [0, {world})")
    q_heads = _even(text.num_heads, world, rank, "num_attention_heads")
    if world <= text.num_kv_heads:
        kv_heads = _even(text.num_kv_heads, world, rank, "num_key_value_heads")
    elif world % text.num_kv_heads:
        raise ShardingError(
            f"--tensor-parallel {world} exceeds num_key_value_heads={text.num_kv_heads} and is not a multiple of it: "
            "KV heads are replicated only in whole groups of ranks"
        )
    else:
        head = rank // (world // text.num_kv_heads)
        kv_heads = Span(head, head + 1)
    any_moe = any(text.moe_layers)
    if expert_parallel and not any_moe:
        raise ShardingError("--expert-parallel needs a model with MoE layers")
    if expert_parallel:
        experts = _even(text.num_experts, world, rank, "num_local_experts (with --expert-parallel)")
        expert_rows = Span(0, text.moe_intermediate_size)
    else:
        experts = Span(0, text.num_experts)
        expert_rows = (
            _even(text.moe_intermediate_size, world, rank, "the experts' intermediate_size")
            if any_moe
            else Span(0, text.moe_intermediate_size)
        )
    dense_rows = (
        _even(text.dense_intermediate_size, world, rank, "dense_intermediate_size")
        if not all(text.moe_layers)
        else Span(0, 0)
    )
    shared_rows = (
        _even(text.shared_intermediate_size, world, rank, "shared_intermediate_size") if any_moe else Span(0, 0)
    )
    vocab_shard = -(-text.vocab_size // world)
    vocab = Span(min(rank * vocab_shard, text.vocab_size), min((rank + 1) * vocab_shard, text.vocab_size))
    return ShardPlan(
        rank=rank,
        world=world,
        expert_parallel=expert_parallel,
        q_heads=q_heads,
        kv_heads=kv_heads,
        dense_rows=dense_rows,
        shared_rows=shared_rows,
        expert_rows=expert_rows,
        experts=experts,
        vocab=vocab,
        vocab_shard=vocab_shard,
    )
