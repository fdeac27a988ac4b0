"""The reference backend over a paged cache equals the MSA oracle on contiguous keys, for a ragged batch."""

import random

import pytest
import torch

from m3stack.engine.attention import reference as backend_module
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.msa.reference import dense_causal_attention, index_block_topk, sparse_attention
from m3stack.engine.msa.store import store_kv

B, HQ, HKV, D, DI, TOPK, LOCAL = 16, 4, 2, 16, 8, 3, 1
# (tokens already cached, new tokens): a prefix hit with a chunk, a fresh prefill, a decode, a tail chunk.
REQUESTS = [(20, 13), (0, 50), (70, 1), (33, 30)]


def _step(seed: int):
    generator = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(2, HKV, D, B, DI, (False, True), torch.float32)
    caches = allocate_kv_cache(spec, 40, "cpu")
    for cache in caches:
        for tensor in (cache.key, cache.value, cache.index_key):
            if tensor is not None:
                tensor.fill_(float("nan"))
    pages = list(range(40))
    random.Random(seed).shuffle(pages)
    full, page_rows, slots, positions, starts = [], [], [], [], [0]
    for cached, new in REQUESTS:
        total = cached + new
        seq_pages = torch.tensor([pages.pop() for _ in range(-(-total // B))])
        pos = torch.arange(total)
        seq_slots = seq_pages[pos // B] * B + pos % B
        tensors = {
            "k": torch.randn(total, HKV, D, generator=generator),
            "v": torch.randn(total, HKV, D, generator=generator),
            "ik": torch.randn(total, DI, generator=generator),
            "q": torch.randn(total, HQ, D, generator=generator),
            "iq": torch.randn(total, HKV, DI, generator=generator),
        }
        for layer, cache in enumerate(caches):  # the cached prefix, written by earlier steps
            store_kv(cache, seq_slots[:cached], tensors["k"][:cached], tensors["v"][:cached],
                     tensors["ik"][:cached] if layer == 1 else None)  # fmt: skip
        full.append((cached, tensors))
        page_rows.append(seq_pages)
        slots.append(seq_slots[cached:])
        positions.append(pos[cached:])
        starts.append(starts[-1] + new)
    page_table = torch.zeros((len(REQUESTS), max(len(p) for p in page_rows)), dtype=torch.int32)
    for r, row in enumerate(page_rows):
        page_table[r, : len(row)] = row
    seq_lens = torch.tensor([c + n for c, n in REQUESTS], dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    metadata = AttentionMetadata(B, starts_t, seq_lens, torch.cat(positions), torch.cat(slots), page_table,
                                 starts_t, seq_lens)  # fmt: skip
    new = {key: torch.cat([t[key][c:] for c, t in full]) for key in ("q", "k", "v", "ik", "iq")}
    return caches, metadata, full, new


def _expected(full, layer: int) -> torch.Tensor:
    out = []
    for cached, t in full:
        pos = torch.arange(cached, t["k"].shape[0])
        q = t["q"][cached:]
        if layer == 0:
            out.append(dense_causal_attention(q, t["k"], t["v"], pos, D**-0.5))
        else:
            selected = index_block_topk(t["iq"][cached:], t["ik"], pos, B, TOPK, LOCAL)
            out.append(sparse_attention(q, t["k"], t["v"], pos, selected, B, D**-0.5))
    return torch.cat(out)


@pytest.mark.parametrize("budget", [backend_module.SCORE_BUDGET_BYTES, 1])
def test_paged_ragged_batch_equals_the_oracle_on_contiguous_keys(monkeypatch, budget):
    monkeypatch.setattr(backend_module, "SCORE_BUDGET_BYTES", budget)  # 1: one query row per slice
    rows_per_call = []
    for name in ("dense_causal_attention", "sparse_attention"):
        real = getattr(backend_module, name)

        def counting(q, *args, _real=real, **kwargs):
            rows_per_call.append(q.shape[0])
            return _real(q, *args, **kwargs)

        monkeypatch.setattr(backend_module, name, counting)
    caches, metadata, full, new = _step(seed=budget % 7)
    backend = ReferenceAttentionBackend(caches, topk_blocks=TOPK, local_blocks=LOCAL)
    backend.begin_step(metadata)
    dense = backend.dense(0, new["q"], new["k"], new["v"])
    sparse = backend.sparse(1, new["q"], new["k"], new["v"], new["iq"], new["ik"])
    torch.testing.assert_close(dense, _expected(full, 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse, _expected(full, 1), rtol=1e-5, atol=1e-5)
    new_tokens = sum(n for _, n in REQUESTS)
    expected_calls = 2 * (new_tokens if budget == 1 else len(REQUESTS))
    assert len(rows_per_call) == expected_calls and sum(rows_per_call) == 2 * new_tokens


def test_misuse_is_a_clear_error():
    caches, metadata, _, new = _step(seed=3)
    backend = ReferenceAttentionBackend(caches, topk_blocks=TOPK, local_blocks=LOCAL)
    with pytest.raises(RuntimeError, match="begin_step"):
        backend.dense(0, new["q"], new["k"], new["v"])
    backend.begin_step(metadata)
    with pytest.raises(ValueError, match="index-key cache"):
        backend.sparse(0, new["q"], new["k"], new["v"], new["iq"], new["ik"])
    metadata.block_size = 32
    with pytest.raises(ValueError, match="page size"):
        backend.begin_step(metadata)
