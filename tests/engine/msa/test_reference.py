"""The fp32 MSA reference against the HF transformers M3 modules (the oracle), on random weights."""

from dataclasses import dataclass, field

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

from m3stack.engine.msa import reference

HIDDEN = 64
HEAD_DIM = 32
INDEX_DIM = 32
BLOCK = 8


def tiny_config(topk: int, local_blocks: int) -> MiniMaxM3VLTextConfig:
    config = MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        index_n_heads=2,
        index_head_dim=INDEX_DIM,
        index_block_size=BLOCK,
        index_topk_blocks=topk,
        index_local_blocks=local_blocks,
        layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "dense"],
        dense_intermediate_size=32,
        rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "eager"
    return config


@dataclass
class LayerCapture:
    """What one attention layer saw and produced during one HF forward call."""

    q: torch.Tensor | None = None  # [T, Hq, D] after norm and RoPE
    out: torch.Tensor | None = None  # [T, Hq, D] attention output (input of o_proj)
    index_q: torch.Tensor | None = None  # [T, Hidx, d] after norm and RoPE
    selected: torch.Tensor | None = None  # [Hidx, T, topk'] HF block indices
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    positions: torch.Tensor | None = None


@dataclass
class Recorder:
    layers: dict[int, LayerCapture] = field(default_factory=dict)

    def attach(self, model: hf.MiniMaxM3VLTextModel) -> None:
        for idx, layer in enumerate(model.layers):
            attn = layer.self_attn
            attn.register_forward_pre_hook(self._on_attention(idx), with_kwargs=True)
            attn.q_norm.register_forward_hook(self._on_q_norm(idx, "q", attn.head_dim))
            attn.o_proj.register_forward_pre_hook(self._on_o_proj(idx))
            if attn.indexer is not None:
                attn.indexer.q_norm.register_forward_hook(self._on_q_norm(idx, "index_q", INDEX_DIM))
                attn.indexer.register_forward_hook(self._on_indexer(idx))

    def _on_attention(self, idx: int):
        def hook(_module, _args, kwargs):
            self.layers[idx] = LayerCapture(rope=kwargs["position_embeddings"], positions=kwargs["position_ids"][0])

        return hook

    def _on_q_norm(self, idx: int, name: str, dim: int):
        def hook(_module, _args, output):
            cos, sin = self.layers[idx].rope
            rotated, _ = hf.apply_rotary_pos_emb(
                output.transpose(1, 2), output.transpose(1, 2), cos[..., :dim], sin[..., :dim]
            )
            setattr(self.layers[idx], name, rotated[0].transpose(0, 1))

        return hook

    def _on_o_proj(self, idx: int):
        def hook(_module, args):
            self.layers[idx].out = args[0][0].view(args[0].shape[1], -1, HEAD_DIM)

        return hook

    def _on_indexer(self, idx: int):
        def hook(_module, _args, output):
            self.layers[idx].selected = output[0]

        return hook


def as_sets(selected: torch.Tensor) -> list[list[set[int]]]:
    return [[{int(b) for b in row if b >= 0} for row in head] for head in selected]


@pytest.mark.parametrize(("topk", "local_blocks", "steps"), [(4, 1, (45, 3, 1)), (5, 2, (61, 1, 4)), (16, 1, (29, 2))])
def test_reference_matches_hf_over_prefill_and_multi_token_steps(topk: int, local_blocks: int, steps: tuple) -> None:
    """Prefill a context that is not a multiple of the block, then steps of several query tokens."""
    torch.manual_seed(1000 * topk + sum(steps))
    config = tiny_config(topk, local_blocks)
    model = hf.MiniMaxM3VLTextModel(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():  # HF zero-inits norms; random weights everywhere exercise them
            param.normal_(0.0, 0.5)
    recorder = Recorder()
    recorder.attach(model)
    cache = DynamicCache(config=config)
    scale = HEAD_DIM**-0.5
    for num_new in steps:
        with torch.no_grad():
            model(inputs_embeds=torch.randn(1, num_new, HIDDEN), cache=cache, use_cache=True)
        dense, sparse = recorder.layers[0], recorder.layers[1]
        k0, v0 = cache.layers[0].keys[0].transpose(0, 1), cache.layers[0].values[0].transpose(0, 1)
        want = dense.out
        got = reference.dense_causal_attention(dense.q, k0, v0, dense.positions, scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

        index_k = cache.layers[1].idx_keys[0, 0]
        selected = reference.index_block_topk(sparse.index_q, index_k, sparse.positions, BLOCK, topk, local_blocks)
        assert selected.shape == (2, num_new, topk)
        assert as_sets(selected) == as_sets(sparse.selected)
        # The block holding the query is the last valid entry of every row.
        num_valid = (selected >= 0).sum(-1)
        last = selected.gather(-1, (num_valid - 1)[..., None])[..., 0]
        assert torch.equal(last, (sparse.positions // BLOCK)[None].expand_as(last))

        k1, v1 = cache.layers[1].keys[0].transpose(0, 1), cache.layers[1].values[0].transpose(0, 1)
        got = reference.sparse_attention(sparse.q, k1, v1, sparse.positions, selected, BLOCK, scale)
        torch.testing.assert_close(got, sparse.out, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lower_block_id() -> None:
    """All-equal scores (the MiniMax reference test): the lowest ids win, the local block comes last."""
    index_q = torch.randn(1, 3, 16)
    index_k = torch.zeros(18 * 4, 16)
    positions = torch.tensor([17 * 4 + 1])
    selected = reference.index_block_topk(index_q, index_k, positions, block_size=4, topk=16, local_blocks=1)
    assert selected[:, 0].tolist() == [[*range(15), 17]] * 3


def test_short_context_selects_every_block_and_pads() -> None:
    index_q = torch.randn(2, 2, 8)
    index_k = torch.randn(11, 8)
    positions = torch.tensor([3, 10])
    selected = reference.index_block_topk(index_q, index_k, positions, block_size=4, topk=5, local_blocks=1)
    assert selected[:, 0].tolist() == [[0, -1, -1, -1, -1]] * 2
    assert sorted(selected[0, 1, :2].tolist()) == [0, 1] and selected[0, 1, 2:].tolist() == [2, -1, -1]


def test_sparse_attention_equals_dense_when_every_block_is_selected() -> None:
    torch.manual_seed(3)
    q, k, v = torch.randn(5, 4, 16), torch.randn(23, 2, 16), torch.randn(23, 2, 16)
    positions = torch.tensor([0, 7, 8, 15, 22])
    every_block = torch.arange(6).expand(2, 5, 6)
    sparse = reference.sparse_attention(q, k, v, positions, every_block, 4, 0.25)
    torch.testing.assert_close(sparse, reference.dense_causal_attention(q, k, v, positions, 0.25))


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    index_q, index_k = torch.randn(2, 2, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="q_positions must lie"):
        reference.index_block_topk(index_q, index_k, torch.tensor([3, 10]), 4, 4, 1)
    with pytest.raises(ValueError, match="local_blocks"):
        reference.index_block_topk(index_q, index_k, torch.tensor([3, 9]), 4, 2, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        reference.dense_causal_attention(
            torch.randn(1, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.tensor([3]), 1.0
        )
    with pytest.raises(ValueError, match="selected has shape"):
        reference.sparse_attention(
            torch.randn(1, 4, 8),
            torch.randn(4, 2, 8),
            torch.randn(4, 2, 8),
            torch.tensor([3]),
            torch.zeros(1, 1, 2, dtype=torch.int64),
            4,
            1.0,
        )
