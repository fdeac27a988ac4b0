"""The paged-cache store kernel (Triton, interpreted on CPU) and its torch fallback."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.msa import store

BLOCK, HKV, HEAD_DIM, INDEX_DIM, PAGES = 16, 3, 24, 20, 6


def poisoned_layers(dtype: torch.dtype) -> list:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK,
                       index_head_dim=INDEX_DIM, sparse_layers=(False, True), dtype=dtype)  # fmt: skip
    layers = allocate_kv_cache(spec, PAGES, "cpu")
    for layer in layers:
        for tensor in (layer.key, layer.value, layer.index_key):
            if tensor is not None:
                tensor.fill_(float("nan"))
    return layers


@pytest.fixture(params=["triton", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(store, "use_triton", lambda _tensor: request.param == "triton")
    return request.param


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_writes_exactly_the_mapped_slots(path: str, cache_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    # Slots on several pages, out of order, including the first and last slot of a page; -1 is padding.
    slots = torch.tensor([5 * BLOCK + 3, 0, -1, 2 * BLOCK + BLOCK - 1, 2 * BLOCK, 4 * BLOCK + 9])
    num_tokens = slots.shape[0]
    k = torch.randn(num_tokens, HKV, HEAD_DIM, generator=generator).to(cache_dtype)
    v = torch.randn(num_tokens, HKV, HEAD_DIM, generator=generator).to(cache_dtype)
    index_k = torch.randn(num_tokens, INDEX_DIM, generator=generator).to(cache_dtype)
    dense, sparse = poisoned_layers(cache_dtype)
    store.store_kv(dense, slots, k, v)
    store.store_kv(sparse, slots, k, v, index_k)

    written = torch.zeros(PAGES, BLOCK, dtype=torch.bool)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, BLOCK)
        written[page, offset] = True
        for layer in (dense, sparse):
            torch.testing.assert_close(layer.key[page, :, offset], k[token], rtol=0, atol=0)
            torch.testing.assert_close(layer.value[page, :, offset], v[token], rtol=0, atol=0)
        torch.testing.assert_close(sparse.index_key[page, offset], index_k[token], rtol=0, atol=0)
    # Everything else is untouched (still the NaN poison).
    for layer in (dense, sparse):
        assert layer.key.permute(0, 2, 1, 3)[~written].isnan().all()
        assert layer.value.permute(0, 2, 1, 3)[~written].isnan().all()
    assert sparse.index_key[~written].isnan().all()


def test_strided_inputs_from_a_fused_projection(path: str) -> None:
    """K and V are often views into one qkv projection output: non-contiguous token strides."""
    qkv = torch.randn(4, 2 * HKV + 1, HEAD_DIM)
    k, v = qkv[:, :HKV], qkv[:, HKV : 2 * HKV]
    _, layer = poisoned_layers(torch.float32)
    index_k = torch.randn(4, 2 * INDEX_DIM)[:, :INDEX_DIM]
    slots = torch.tensor([17, 18, 40, 95])
    store.store_kv(layer, slots, k, v, index_k)
    pages, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(layer.key[pages, :, offsets], k)
    assert torch.equal(layer.value[pages, :, offsets], v)
    assert torch.equal(layer.index_key[pages, offsets], index_k)


def test_bad_input_is_rejected_before_anything_is_written() -> None:
    dense, sparse = poisoned_layers(torch.float32)
    slots = torch.tensor([1, 2])
    k = torch.randn(2, HKV, HEAD_DIM)
    with pytest.raises(ValueError, match="k has shape"):
        store.store_kv(dense, slots, k[:1], k)
    with pytest.raises(ValueError, match="index_k must be given"):
        store.store_kv(sparse, slots, k, k)
    with pytest.raises(ValueError, match="index_k must be given"):
        store.store_kv(dense, slots, k, k, torch.randn(2, INDEX_DIM))
    with pytest.raises(ValueError, match="index_k has shape"):
        store.store_kv(sparse, slots, k, k, torch.randn(2, INDEX_DIM + 1))
    assert dense.key.isnan().all() and sparse.key.isnan().all() and sparse.index_key.isnan().all()
