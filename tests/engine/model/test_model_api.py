"""The runtime-facing surface of M3ForServing: cache spec and input checks that fail before any work."""

import pytest
import torch

from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.tensors import allocate_kv_cache
from m3stack.engine.model.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def test_kv_cache_spec_follows_the_config(model):
    text = model.config.text
    spec = model.kv_cache_spec(torch.bfloat16)
    assert spec.block_size == text.index_block_size and spec.dtype == torch.bfloat16
    assert spec.sparse_layers == text.sparse_layers and any(spec.sparse_layers) and not all(spec.sparse_layers)
    caches = allocate_kv_cache(spec, 3, "cpu")
    assert [c.index_key is not None for c in caches] == list(text.sparse_layers)
    assert caches[0].key.shape == (3, text.num_kv_heads, text.index_block_size, text.head_dim)


@pytest.mark.parametrize(
    ("ids", "positions", "rows", "embeds", "message"),
    [
        (torch.zeros((1, 4), dtype=torch.long), torch.zeros((1, 4), dtype=torch.long), None, None, "must be \\[T\\]"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long), None, None, "must be \\[T\\]"),
        (torch.zeros(4, dtype=torch.long), torch.arange(4), torch.tensor([1]), None, "go together"),
        (torch.zeros(4, dtype=torch.long), torch.arange(4), torch.tensor([1]), torch.zeros(2, 64), "expected \\[N\\]"),
    ],
)
def test_forward_rejects_malformed_inputs(model, ids, positions, rows, embeds, message):
    backend = ReferenceAttentionBackend([], topk_blocks=4, local_blocks=1)
    with pytest.raises(ValueError, match=message):
        model.forward(ids, positions, backend, rows, embeds)
