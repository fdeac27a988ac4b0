"""The paged-cache store kernel (Triton, interpreted on CPU) and its torch fallback."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from dataclasses import replace

import pytest
import torch

from m3stack.engine.kv_cache.tensors import (
    INDEX_DTYPES,
    KV_CACHE_DTYPES,
    KVCacheSpec,
    allocate_kv_cache,
    dequantize_index_keys,
    quantize_index_keys,
)
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


def test_fp8_index_keys_are_stored_with_a_scale_per_token(path: str) -> None:
    """An fp8 k-index: each key is stored as e4m3 ``key / scale`` with ``scale = max |key| / 448`` beside it in its
    page; both paths write the same bytes, and the dequantized key is within e4m3's rounding (2^-4 relative)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=INDEX_DIM,
                       sparse_layers=(True,), dtype=torch.float32, index_dtype=torch.float8_e4m3fn)  # fmt: skip
    (layer,) = allocate_kv_cache(spec, PAGES, "cpu")
    assert layer.index_key.dtype == torch.float8_e4m3fn and layer.index_key_scale.shape == (PAGES, BLOCK)
    layer.index_key_scale.fill_(float("nan"))
    generator = torch.Generator().manual_seed(3)
    slots = torch.tensor([5 * BLOCK + 3, 0, -1, 2 * BLOCK + BLOCK - 1])
    k = torch.randn(4, HKV, HEAD_DIM, generator=generator)
    # Keys of very different norms, and an all-zero key (scale 1).
    index_k = torch.randn(4, INDEX_DIM, generator=generator) * torch.tensor([[1e-3], [1.0], [7.0], [0.0]])
    store.store_kv(layer, slots, k, k, index_k)
    pages, offsets = slots[slots >= 0] // BLOCK, slots[slots >= 0] % BLOCK
    kept = index_k[slots >= 0]
    want_keys, want_scale = quantize_index_keys(kept)
    assert torch.equal(layer.index_key_scale[pages, offsets], want_scale)
    assert want_scale[-1] == 1.0
    assert torch.equal(layer.index_key[pages, offsets].view(torch.uint8), want_keys.view(torch.uint8))
    dequantized = dequantize_index_keys(layer.index_key[pages, offsets], layer.index_key_scale[pages, offsets])
    torch.testing.assert_close(dequantized, kept, rtol=2**-4, atol=0)
    untouched = torch.ones(PAGES, BLOCK, dtype=torch.bool)
    untouched[pages, offsets] = False
    assert layer.index_key_scale[untouched].isnan().all()


def test_an_fp8_kv_cache_stores_values_clamped_to_e4m3s_range(path: str) -> None:
    """``--kv-cache-dtype fp8_e4m3``: K and V cast to e4m3 (scale 1), values past +-448 clamped (a plain cast would
    store NaN); both paths write the same bytes.  The Triton interpreter (3.9) rounds fp32 -> e4m3 without carrying a
    rounded-up mantissa into the exponent (7.8 -> 4.0; the GPU's cvt.rn.satfinite does not), so under it V holds
    values e4m3 represents and only the torch path rounds."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=INDEX_DIM,
                       sparse_layers=(True,), dtype=torch.float32, kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    (layer,) = allocate_kv_cache(spec, PAGES, "cpu")
    assert (
        layer.key.dtype == layer.value.dtype == torch.float8_e4m3fn and spec.kv_page_bytes == 2 * HKV * BLOCK * HEAD_DIM
    )
    generator = torch.Generator().manual_seed(4)
    slots = torch.tensor([3, 2 * BLOCK + 5])
    k = torch.randn(2, HKV, HEAD_DIM, generator=generator) * 3
    k[0, 0, :3] = torch.tensor([1000.0, -5000.0, 448.0])
    v = torch.randn(2, HKV, HEAD_DIM, generator=generator)
    if path == "triton":
        k, v = (x.clamp(-448, 448).to(torch.float8_e4m3fn).float() for x in (k, v))
        k[0, 0, :2] = torch.tensor([1000.0, -5000.0])
    store.store_kv(layer, slots, k, v, torch.randn(2, INDEX_DIM, generator=generator))
    pages, offsets = slots // BLOCK, slots % BLOCK
    stored_k, stored_v = layer.key[pages, :, offsets], layer.value[pages, :, offsets]
    assert torch.equal(stored_k.view(torch.uint8), k.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(stored_v.view(torch.uint8), v.to(torch.float8_e4m3fn).view(torch.uint8))
    assert stored_k[0, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    torch.testing.assert_close(stored_v.float(), v, rtol=2**-4, atol=2**-9)


def test_an_fp8_k_index_page_is_its_keys_then_their_scales() -> None:
    """Sizes the KV budget counts: a page of fp8 index keys is B x d bytes plus B float32 scales."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=INDEX_DIM,
                       sparse_layers=(False, True), dtype=torch.bfloat16, index_dtype=torch.float8_e4m3fn)  # fmt: skip
    assert spec.index_page_bytes == BLOCK * (INDEX_DIM + 4)
    assert spec.bytes_per_page == 2 * spec.kv_page_bytes + spec.index_page_bytes
    assert replace(spec, index_dtype=None).index_page_bytes == BLOCK * INDEX_DIM * 2
    with pytest.raises(ValueError, match="index_dtype"):
        replace(spec, index_dtype=torch.float16)


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


def test_the_cache_dtype_names_are_the_engine_flags_and_the_crd_fields_choices() -> None:
    """One set of names: ``kv_cache.tensors``' maps, the engine's --index-dtype / --kv-cache-dtype choices (which
    keep torch out of the command line) and the CRD's enums."""
    from m3stack.cli import build_parser
    from m3stack.operator import spec_schema

    engine = build_parser()._subparsers._group_actions[0].choices["engine"]
    choices = {
        action.option_strings[0]: tuple(action.choices or ()) for action in engine._actions if action.option_strings
    }
    assert choices["--index-dtype"] == tuple(INDEX_DTYPES) == spec_schema.INDEX_DTYPES
    assert choices["--kv-cache-dtype"] == tuple(KV_CACHE_DTYPES) == spec_schema.KV_CACHE_DTYPES
