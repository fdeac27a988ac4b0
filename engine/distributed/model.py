"""One rank's model: built at its local sizes (never the whole model first), weights read slice by slice.

``ShardedM3`` is ``M3ForServing`` with its attention, MLPs, MoE and LM head swapped for the parallel layers
at this rank's sizes, built on the meta device and materialized once on the target device, so a rank allocates
only its shard.  Only rank 0 keeps the vision tower and projector.  ``load_sharded_model`` validates the whole
checkpoint against config.json from the headers (``engine.model.loader.scan_checkpoint``, as one GPU does), then
reads from each tensor only the rows or columns this rank owns (safetensors slices: the rest is never read).

An MXFP8 checkpoint's scales (``<name>_scale_inv``, one byte per 32 inputs) go with their weights: the same
rows, and a column slice ``a:b`` of the weight is ``a/32:b/32`` of its scales, so a split that cuts a 32-input
block is refused (``ShardingError``) before anything is read.
"""

import logging
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from m3stack.engine.distributed.layers import ReducedAttention, ReducedGatedMLP, ShardedMoE, VocabParallelLMHead
from m3stack.engine.distributed.sharding import ShardingError, ShardPlan, Span
from m3stack.engine.kv_cache.tensors import KVCacheSpec
from m3stack.engine.model.config import M3Config, load_config
from m3stack.engine.model.loader import scan_checkpoint
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.model.mxfp8 import quantize_parameters
from m3stack.engine.model.quantization import BLOCK_SIZE, SCALE_SUFFIX
from m3stack.engine.model.weights import CheckpointTensor

logger = logging.getLogger(__name__)

Index = tuple[int | slice, ...]


class ShardedM3(M3ForServing):
    def __init__(
        self,
        config: M3Config,
        plan: ShardPlan,
        dtype: torch.dtype,
        device: torch.device | str,
        quantized: Collection[str] = (),
    ) -> None:
        super().__init__(config, dtype, "meta")
        self.plan = plan
        text = config.text
        local = plan.local_text(text)
        args = {"dtype": dtype, "device": "meta"}
        for index, layer in enumerate(self.layers):
            layer.attn = ReducedAttention(local, index, **args)
            if text.moe_layers[index]:
                layer.mlp = ShardedMoE(
                    text,
                    experts=range(plan.experts.start, plan.experts.stop),
                    expert_rows=plan.expert_rows.size,
                    shared_rows=plan.shared_rows.size,
                    **args,
                )
            else:
                layer.mlp = ReducedGatedMLP(
                    text.hidden_size, plan.dense_rows.size, alpha=text.swiglu_alpha, limit=text.swiglu_limit, **args
                )
        self.lm_head = VocabParallelLMHead(
            text.hidden_size, range(plan.vocab.start, plan.vocab.stop), plan.vocab_shard, text.vocab_size, **args
        )
        if not plan.is_leader:
            self.vision = None
            self.projector = None
        quantize_parameters(self, quantized)  # this rank's shapes of the MXFP8 parameters, with their scales
        self.materialize(device)
        if text.tie_word_embeddings:
            rows = self.embed_tokens.weight[plan.vocab.start : plan.vocab.stop]
            self.lm_head.weight = torch.nn.Parameter(rows, requires_grad=False)

    def kv_cache_spec(self, dtype: torch.dtype | None = None) -> KVCacheSpec:
        """This rank's KV heads; the index-key cache (one shared head) is whole on every rank."""
        return replace(super().kv_cache_spec(dtype), num_kv_heads=self.plan.kv_heads.size)

    def local_config(self) -> M3Config:
        """The config with this rank's head counts (what the attention backend must be built for)."""
        return replace(self.config, text=self.plan.local_text(self.config.text))


@dataclass(frozen=True)
class Piece:
    """Which part of a checkpoint tensor a rank reads (``source``) and where it goes (``param[target]``)."""

    source: Index
    param: str
    target: Index


def _rows(span: Span) -> slice:
    return slice(span.start, span.stop)


def _fused_half(target: Index, local_rows: int, index: int | None = None) -> Index:
    """gate|up fused along rows: the checkpoint's gate starts at row 0, its up at row ``inter``."""
    gate = target[-1].start in (0, None)  # type: ignore[union-attr]
    half = slice(0, local_rows) if gate else slice(local_rows, 2 * local_rows)
    return (half,) if index is None else (index, half)


def shard_piece(spec: CheckpointTensor, plan: ShardPlan, config: M3Config) -> Piece | None:
    """What rank ``plan.rank`` reads of ``spec``; None when it holds none of it."""
    if spec.param.endswith(SCALE_SUFFIX):
        return _scale_piece(spec, plan, config)
    param, text = spec.param, config.text
    if param.startswith(("vision.", "projector.")):
        return Piece((), param, spec.index) if plan.is_leader else None
    if param == "lm_head.weight":
        return Piece((_rows(plan.vocab),), param, ())
    if param.endswith(".attn.in_proj.weight"):
        return _attention_rows(spec, plan, config)
    if param.endswith(".attn.o_proj.weight"):
        d = text.head_dim
        return Piece((slice(None), slice(plan.q_heads.start * d, plan.q_heads.stop * d)), param, ())
    if ".mlp." not in param or ".router." in param:
        return Piece((), param, spec.index)
    shared = ".shared_expert." in param
    expert_index = spec.index[0] if spec.index and isinstance(spec.index[0], int) else None
    if expert_index is not None:  # a routed expert: (e, gate/up rows) or (e,) for down
        if not plan.experts.start <= expert_index < plan.experts.stop:
            return None
        local = expert_index - plan.experts.start
        rows = plan.expert_rows
        if param.endswith("gate_up_proj"):
            return Piece((_rows(rows),), param, _fused_half(spec.index, rows.size, local))
        return Piece((slice(None), _rows(rows)), param, (local,))
    rows = plan.shared_rows if shared else plan.dense_rows
    if param.endswith("gate_up_proj.weight"):
        return Piece((_rows(rows),), param, _fused_half(spec.index, rows.size))
    return Piece((slice(None), _rows(rows)), param, ())


def _scale_piece(spec: CheckpointTensor, plan: ShardPlan, config: M3Config) -> Piece | None:
    """An MXFP8 scale tensor's piece: its weight's, with the input (last) dimension's slice in 32-input blocks."""
    weight = replace(
        spec,
        name=spec.name.removesuffix(SCALE_SUFFIX),
        shape=(*spec.shape[:-1], spec.shape[-1] * BLOCK_SIZE),
        param=spec.param.removesuffix(SCALE_SUFFIX),
    )
    piece = shard_piece(weight, plan, config)
    if piece is None:
        return None
    expert_stack = bool(spec.index) and isinstance(spec.index[0], int)  # [E, N, K] rather than [N, K]
    return Piece(
        _in_blocks(piece.source, len(spec.shape), weight.name),
        spec.param,
        _in_blocks(piece.target, 3 if expert_stack else 2, weight.name),
    )


def _in_blocks(index: Index, ndim: int, name: str) -> Index:
    """``index`` over a weight of ``ndim`` dimensions, its slice of the last one counted in scale blocks."""
    if len(index) < ndim or not isinstance(index[-1], slice) or index[-1] == slice(None):
        return index
    start, stop = index[-1].start or 0, index[-1].stop
    if start % BLOCK_SIZE or (stop is not None and stop % BLOCK_SIZE):
        raise ShardingError(
            f"{name}: this split gives a rank inputs {start}:{stop}, which cut its MXFP8 scale blocks of "
            f"{BLOCK_SIZE}; choose a --tensor-parallel (or --expert-parallel) that keeps whole blocks"
        )
    return (*index[:-1], slice(start // BLOCK_SIZE, None if stop is None else stop // BLOCK_SIZE))


def _attention_rows(spec: CheckpointTensor, plan: ShardPlan, config: M3Config) -> Piece:
    """q, k, v, index-q, index-k rows of one layer's fused projection, in the rank's local order."""
    text = config.text
    d, di = text.head_dim, text.index_head_dim
    hq, hkv = plan.q_heads.size, plan.kv_heads.size
    kind = spec.name.split(".")[-2]
    local_starts = {
        "q_proj": 0,
        "k_proj": hq * d,
        "v_proj": (hq + hkv) * d,
        "index_q_proj": (hq + 2 * hkv) * d,
        "index_k_proj": (hq + 2 * hkv) * d + hkv * di,
    }
    sources = {
        "q_proj": slice(plan.q_heads.start * d, plan.q_heads.stop * d),
        "k_proj": slice(plan.kv_heads.start * d, plan.kv_heads.stop * d),
        "v_proj": slice(plan.kv_heads.start * d, plan.kv_heads.stop * d),
        "index_q_proj": slice(plan.kv_heads.start * di, plan.kv_heads.stop * di),
        "index_k_proj": slice(0, di),
    }
    source = sources[kind]
    start = local_starts[kind]
    return Piece((source,), spec.param, (slice(start, start + source.stop - source.start),))


def load_sharded_model(
    path: str | Path, plan: ShardPlan, device: torch.device | str, dtype: torch.dtype
) -> tuple[ShardedM3, M3Config]:
    config = load_config(path)
    scan = scan_checkpoint(path, config)
    # Every piece before any read: a split the checkpoint's layout refuses fails before loading.
    pieces = {spec.name: shard_piece(spec, plan, config) for specs in scan.files.values() for spec in specs}
    model = ShardedM3(config, plan, dtype, device, quantized=scan.quantized)
    params = dict(model.named_parameters(remove_duplicate=False))
    read = 0
    with (
        torch.no_grad(),
        tqdm(total=scan.num_tensors, unit="tensor", desc=f"rank {plan.rank} weights", leave=False) as bar,
    ):
        for file, specs in scan.files.items():
            with safe_open(str(file), framework="pt") as reader:
                for spec in specs:
                    piece = pieces[spec.name]
                    bar.update()
                    if piece is None:
                        continue
                    tensor = reader.get_slice(spec.name)[piece.source] if piece.source else reader.get_tensor(spec.name)
                    target = params[piece.param][piece.target] if piece.target else params[piece.param]
                    if target.shape != tensor.shape:  # a bug in the slicing, not in the checkpoint
                        raise AssertionError(
                            f"{spec.name}{piece.source} {tuple(tensor.shape)} -> {piece.param}"
                            f"{piece.target} {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    read += tensor.numel()
    logger.info("rank %d read %.2f G values of its shard", plan.rank, read / 1e9)
    return model.eval(), config
