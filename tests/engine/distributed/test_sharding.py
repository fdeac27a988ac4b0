"""Which slices each rank owns, and that the shards read from the checkpoint tile the full model's weights.

The second test loads every rank's shard in this process (no process group is needed to load) and puts the
pieces back together by head, row and expert, comparing with the single-GPU model: a slice read from the wrong
rows, or one rank missing, fails it.
"""

import itertools

import pytest
import torch

from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.distributed.model import load_sharded_model
from m3stack.engine.distributed.sharding import ShardingError, plan_shards
from m3stack.engine.model.config import parse_config
from m3stack.engine.model.loader import load_model

# M3's text dims (64 query heads, 4 KV heads, 128 experts); the rest of the config does not matter here.
M3_TEXT = {
    "vocab_size": 200064,
    "hidden_size": 6144,
    "num_hidden_layers": 2,
    "layer_types": ["full_attention", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse"],
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "dense_intermediate_size": 12288,
    "intermediate_size": 3072,
    "shared_intermediate_size": 3072,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "index_n_heads": 4,
    "index_head_dim": 128,
}


@pytest.fixture(scope="module")
def m3_text():
    return parse_config({"model_type": "minimax_m3_vl", "text_config": M3_TEXT, "vision_config": {}}).text


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_m3_splits_over_1_2_4_8_ranks(m3_text, world):
    plans = [plan_shards(m3_text, world, rank, expert_parallel=True) for rank in range(world)]
    assert [p.q_heads.start for p in plans] == [rank * 64 // world for rank in range(world)]
    assert all(p.q_heads.size == 64 // world for p in plans)
    for plan in plans:  # every query head's KV head is on its rank: head h uses KV head h // 16
        kv_of_queries = {h // 16 for h in range(plan.q_heads.start, plan.q_heads.stop)}
        assert kv_of_queries <= set(range(plan.kv_heads.start, plan.kv_heads.stop))
    if world <= 4:
        assert sorted(h for p in plans for h in range(p.kv_heads.start, p.kv_heads.stop)) == list(range(4))
    else:  # TP=8: each KV head (and its index query head) on two ranks
        assert [p.kv_heads.start for p in plans] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [p.experts.start for p in plans] == [rank * 128 // world for rank in range(world)]
    vocab = [(p.vocab.start, p.vocab.stop) for p in plans]
    assert vocab[0][0] == 0 and vocab[-1][1] == 200064
    assert all(a[1] == b[0] for a, b in itertools.pairwise(vocab))


def test_tensor_parallel_experts_slice_every_expert(m3_text):
    plan = plan_shards(m3_text, 8, 3, expert_parallel=False)
    assert (plan.experts.start, plan.experts.stop) == (0, 128)
    assert (plan.expert_rows.start, plan.expert_rows.stop) == (3 * 384, 4 * 384)
    assert (plan.dense_rows.start, plan.dense_rows.stop) == (3 * 1536, 4 * 1536)


@pytest.mark.parametrize(
    ("world", "expert_parallel", "message"),
    [
        (3, False, "num_attention_heads"),
        (6, False, "num_attention_heads (64) is not divisible"),
    ],
)
def test_impossible_splits_are_refused_with_the_dimension(m3_text, world, expert_parallel, message):
    with pytest.raises(ShardingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_shards(m3_text, world, 0, expert_parallel)


def _text(**changes):
    raw = {"model_type": "minimax_m3_vl", "text_config": {**M3_TEXT, **changes}, "vision_config": {}}
    return parse_config(raw).text


def test_kv_heads_replicate_only_in_whole_groups():
    text = _text(num_attention_heads=48, num_key_value_heads=8, index_n_heads=8)
    with pytest.raises(ShardingError, match="not a multiple of it"):
        plan_shards(text, 12, 0, False)


def test_expert_parallelism_needs_whole_experts_per_rank():
    text = _text(num_local_experts=96)
    with pytest.raises(ShardingError, match=r"num_local_experts \(with --expert-parallel\) \(96\)"):
        plan_shards(text, 64, 0, True)
    assert plan_shards(text, 64, 0, False).experts.stop == 96  # sliced experts still work


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel": 4, "nnodes": 3}, "multiple of --nnodes"),
        ({"tensor_parallel": 4, "nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank 2"),
        ({"tensor_parallel": 4, "nnodes": 2}, "fixed --master-port"),
        ({"tensor_parallel": 0}, "--tensor-parallel must be >= 1"),
    ],
)
def test_bad_parallel_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def _merge_rows(pieces: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.cat(pieces, dim=dim)


@pytest.mark.parametrize(("world", "expert_parallel"), [(2, False), (2, True), (4, False)])
def test_the_shards_tile_the_full_model(tiny_model_dir, world, expert_parallel):
    full, config = load_model(tiny_model_dir, "cpu", torch.float32)
    text = config.text
    shards = [
        load_sharded_model(tiny_model_dir, plan_shards(text, world, rank, expert_parallel), "cpu", torch.float32)[0]
        for rank in range(world)
    ]
    d, di = text.head_dim, text.index_head_dim
    hq, hkv = text.num_heads * d, text.num_kv_heads * d
    for index, layer in enumerate(full.layers):
        weight = layer.attn.in_proj.weight
        local = [shard.layers[index].attn.in_proj.weight for shard in shards]
        local_q = [w[: text.num_heads // world * d] for w in local]
        assert torch.equal(_merge_rows(local_q), weight[:hq])
        for rank, (shard, w) in enumerate(zip(shards, local, strict=True)):
            plan = shard.plan
            q = text.num_heads // world * d
            kv = plan.kv_heads.size * d
            kv_rows = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
            assert torch.equal(w[q : q + kv], weight[hq:][kv_rows]), f"rank {rank} layer {index} keys"
            assert torch.equal(w[q + kv : q + 2 * kv], weight[hq + hkv :][kv_rows]), f"rank {rank} values"
            if text.sparse_layers[index]:
                index_q = weight[hq + 2 * hkv :][plan.kv_heads.start * di : plan.kv_heads.stop * di]
                assert torch.equal(w[q + 2 * kv : -di], index_q)
                assert torch.equal(w[-di:], weight[-di:])  # the shared index key: on every rank
        o_proj = [shard.layers[index].attn.o_proj.weight for shard in shards]
        assert torch.equal(_merge_rows(o_proj, dim=1), layer.attn.o_proj.weight)
        mlp = layer.mlp
        local_mlps = [shard.layers[index].mlp for shard in shards]
        if text.moe_layers[index]:
            assert all(torch.equal(m.router.weight, mlp.router.weight) for m in local_mlps)
            if expert_parallel:
                assert torch.equal(_merge_rows([m.down_proj for m in local_mlps]), mlp.down_proj)
                assert torch.equal(_merge_rows([m.gate_up_proj for m in local_mlps]), mlp.gate_up_proj)
            else:
                assert torch.equal(_merge_rows([m.down_proj for m in local_mlps], dim=2), mlp.down_proj)
                inter = text.moe_intermediate_size // world
                gates = [m.gate_up_proj[:, :inter] for m in local_mlps]
                ups = [m.gate_up_proj[:, inter:] for m in local_mlps]
                assert torch.equal(_merge_rows(gates + ups, dim=1), mlp.gate_up_proj)
            mlp, local_mlps = mlp.shared_expert, [m.shared_expert for m in local_mlps]
        assert torch.equal(_merge_rows([m.down_proj.weight for m in local_mlps], dim=1), mlp.down_proj.weight)
        half = mlp.gate_up_proj.weight.shape[0] // 2 // world
        gates = [m.gate_up_proj.weight[:half] for m in local_mlps]
        ups = [m.gate_up_proj.weight[half:] for m in local_mlps]
        assert torch.equal(_merge_rows(gates + ups), mlp.gate_up_proj.weight)
    assert torch.equal(_merge_rows([s.lm_head.weight for s in shards])[: text.vocab_size], full.lm_head.weight)
    assert all(torch.equal(s.embed_tokens.weight, full.embed_tokens.weight) for s in shards)
    assert shards[0].vision is not None and all(s.vision is None for s in shards[1:])
    assert torch.equal(shards[0].vision.inv_freq, full.vision.inv_freq)
    assert all(torch.equal(s.inv_freq, full.inv_freq) for s in shards)
