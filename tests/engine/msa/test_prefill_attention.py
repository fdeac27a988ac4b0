"""Sparse prefill attention (KV-block-major and query-major) and its CSR inversion against the fp32
reference, on CPU under the Triton interpreter (float32 and float16; see test_prefill_index)."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.msa import reference
from m3stack.engine.msa.prefill_attention import sparse_prefill
from m3stack.engine.msa.prefill_common import PrefillTuning
from m3stack.engine.msa.prefill_csr import (
    ITEM_BLOCK,
    ITEM_END,
    ITEM_FIRST,
    ITEM_FIRST_KEY,
    ITEM_HEAD,
    ITEM_NUM_KEYS,
    ITEM_PAGE,
    build_block_queries,
)
from m3stack.engine.msa.prefill_plan import global_blocks, token_requests
from tests.engine.msa.prefill_support import PagedBatch, paged_batch, with_fp8_kv

BLOCK = 16
KV_HEADS = 2
GROUP = 2
HEAD_DIM = 16
TOPK = 4
SCALE = HEAD_DIM**-0.5
# Full prefill not a multiple of the block, prefix + chunk starting and ending mid-block, one token.
REQUESTS = [(52, 52), (83, 13), (40, 1)]
# Small query tiles and work items so the loops over tiles and the split of hot blocks both run.
TUNING = PrefillTuning(tile_tokens=8, queries_per_item=16)


def _batch(dtype: torch.dtype, seed: int) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """A batch, its queries and a selection from the reference indexer."""
    generator = torch.Generator().manual_seed(seed)
    batch = paged_batch(
        REQUESTS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, index_dim=16, block_size=BLOCK, dtype=dtype,
        device="cpu", generator=generator,
    )  # fmt: skip
    num_tokens = batch.metadata.num_tokens
    q = torch.randn(num_tokens, KV_HEADS * GROUP, HEAD_DIM, generator=generator).to(dtype)
    index_q = torch.randn(num_tokens, KV_HEADS, 16, generator=generator).to(dtype)
    selection = torch.cat(
        [
            reference.index_block_topk(
                index_q[start:stop], batch.index_keys[r], batch.request_positions(r), BLOCK, TOPK, 1
            )
            for r, (start, stop) in enumerate(batch.token_ranges)
        ],
        dim=1,
    ).to(torch.int32)
    return batch, q, selection


@pytest.fixture(scope="module")
def cases() -> dict[torch.dtype, tuple[PagedBatch, torch.Tensor, torch.Tensor]]:
    return {dtype: _batch(dtype, seed=11) for dtype in (torch.float32, torch.float16)}


def _reference(batch: PagedBatch, q: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [
            reference.sparse_attention(
                q[start:stop], batch.keys[r], batch.values[r], batch.request_positions(r), selection[:, start:stop],
                BLOCK, SCALE,
            )
            for r, (start, stop) in enumerate(batch.token_ranges)
        ]
    )  # fmt: skip


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    tolerance = 1e-5 if out.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("method", "dtype", "workspace_tokens", "prefetch", "merge_tokens"),
    [
        ("block_major", torch.float32, None, True, 1),
        ("block_major", torch.float16, None, True, None),
        ("block_major", torch.float32, 20, True, 3),
        ("block_major", torch.float16, None, False, 4),
        ("query_major", torch.float16, None, None, None),
    ],
    ids=["block-major-fp32", "block-major-fp16", "block-major-chunked", "block-major-pipelined", "query-major-fp16"],
)
def test_matches_reference(
    cases: dict[torch.dtype, tuple[PagedBatch, torch.Tensor, torch.Tensor]],
    method: str,
    dtype: torch.dtype,
    workspace_tokens: int | None,
    prefetch: bool | None,
    merge_tokens: int | None,
) -> None:
    batch, q, selection = cases[dtype]
    kwargs = {}
    # Room for the partials of 20 tokens: the 66 tokens run in 4 chunks, whose 20 tokens are no
    # multiple of the merge's 3 tokens per program (the last group of each chunk is partial).
    if workspace_tokens:
        kwargs["workspace_bytes"] = workspace_tokens * KV_HEADS * GROUP * TOPK * (HEAD_DIM * q.dtype.itemsize + 4)
    tuning = dataclasses.replace(TUNING, prefetch=prefetch, merge_tokens=merge_tokens)
    out = sparse_prefill(
        q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE, method, tuning=tuning, **kwargs
    )
    _assert_close(out, _reference(batch, q, selection))


@pytest.mark.parametrize("method", ["block_major", "query_major"])
def test_an_fp8_kv_cache_is_read_as_the_values_it_holds(method: str) -> None:
    """``--kv-cache-dtype fp8_e4m3``: the kernels widen each K/V tile (exactly) and attend in the queries' dtype, so
    they match the reference over the cache's values."""
    batch, q, selection = _batch(torch.float32, seed=19)
    batch = with_fp8_kv(batch)
    out = sparse_prefill(q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE, method,
                         tuning=TUNING)  # fmt: skip
    _assert_close(out, _reference(batch, q, selection))


@pytest.mark.parametrize("method", ["block_major", "query_major"])
def test_arbitrary_selections(method: str) -> None:
    """Unordered rows with -1 holes, future blocks (ignored like masked keys) and a sink block every
    query picks (one bucket split over several work items)."""
    batch, q, _ = _batch(torch.float32, seed=5)
    generator = torch.Generator().manual_seed(6)
    positions = batch.metadata.positions
    q_block = (positions // BLOCK).to(torch.int32)
    random_blocks = (
        torch.rand(KV_HEADS, len(positions), TOPK, generator=generator) * (q_block + 2)[None, :, None]
    ).int()
    selection = torch.where(torch.rand(random_blocks.shape, generator=generator) < 0.25, -1, random_blocks)
    selection[:, :, 0] = 0  # the sink
    selection[:, :, 1] = torch.where(q_block > 0, q_block, -1)[None]  # the local block, not last
    # Drop repeats inside a row (a selection never repeats a block).
    for head in range(KV_HEADS):
        for token in range(len(positions)):
            seen = set()
            for slot in range(TOPK):
                block = int(selection[head, token, slot])
                if block in seen:
                    selection[head, token, slot] = -1
                seen.add(block)
    out = sparse_prefill(q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE, method, tuning=TUNING)
    _assert_close(out, _reference(batch, q, selection))


def test_block_queries_invert_the_selection() -> None:
    """The CSR lists exactly the (token, slot) pairs that picked each (chunk, head, block) bucket."""
    batch, _, selection = _batch(torch.float32, seed=2)
    metadata = batch.metadata
    blocks = global_blocks(metadata)
    chunk_tokens, per_item = 30, 8
    csr = build_block_queries(
        selection, metadata.positions, token_requests(metadata), blocks, BLOCK, chunk_tokens, per_item
    )
    expected: dict[int, set[int]] = {}
    request_of = token_requests(metadata).tolist()
    for head in range(KV_HEADS):
        for token in range(metadata.num_tokens):
            for slot in range(TOPK):
                block = int(selection[head, token, slot])
                if block < 0:
                    continue
                chunk = token // chunk_tokens
                bucket = (chunk * KV_HEADS + head) * blocks.count + int(blocks.first[request_of[token]]) + block
                expected.setdefault(bucket, set()).add((token % chunk_tokens) * TOPK + slot)
    row_ptr = csr.row_ptr.tolist()
    got = {
        bucket: set(csr.entries[row_ptr[bucket] : row_ptr[bucket + 1]].tolist())
        for bucket in range(len(row_ptr) - 1)
        if row_ptr[bucket + 1] > row_ptr[bucket]
    }
    assert got == expected
    # Work items tile every bucket in runs of at most per_item entries, each chunk's from its own row
    # range; every item row names its block's page, first key position and key count.
    items = csr.items.tolist()
    used = [row for row in items if row[int(ITEM_HEAD)] >= 0]
    got_items = sorted(
        (row[int(ITEM_HEAD)], row[int(ITEM_BLOCK)], row[int(ITEM_FIRST)], row[int(ITEM_END)]) for row in used
    )
    expected_items = []
    for bucket in expected:
        (chunk, head), block = divmod(bucket // blocks.count, KV_HEADS), bucket % blocks.count
        for first in range(row_ptr[bucket], row_ptr[bucket + 1], per_item):
            expected_items.append((head, block, first, min(first + per_item, row_ptr[bucket + 1])))
            chunk_rows = range(chunk * csr.items_per_chunk, (chunk + 1) * csr.items_per_chunk)
            assert any(items[r][int(ITEM_FIRST)] == first and items[r][int(ITEM_HEAD)] == head for r in chunk_rows)
    assert got_items == sorted(expected_items)
    for row in used:
        block = row[int(ITEM_BLOCK)]
        assert row[int(ITEM_PAGE)] == int(blocks.page[block])
        assert row[int(ITEM_FIRST_KEY)] == int(blocks.first_position[block])
        assert row[int(ITEM_NUM_KEYS)] == int(blocks.num_keys[block])


def test_bad_inputs_are_rejected() -> None:
    batch, q, selection = _batch(torch.float32, seed=1)
    k, v, metadata = batch.key_cache, batch.value_cache, batch.metadata
    with pytest.raises(ValueError, match="method"):
        sparse_prefill(q, k, v, selection, metadata, SCALE, "dense")
    with pytest.raises(ValueError, match="selection"):
        sparse_prefill(q, k, v, selection[:1], metadata, SCALE)
    with pytest.raises(ValueError, match="selection"):
        sparse_prefill(q, k, v, selection.float(), metadata, SCALE)
    with pytest.raises(ValueError, match="multiple"):
        sparse_prefill(q[:, :3], k, v, selection, metadata, SCALE)
    with pytest.raises(ValueError, match="head dim"):
        sparse_prefill(q[..., :8], k, v, selection, metadata, SCALE)
    with pytest.raises(ValueError, match="dtype"):
        sparse_prefill(q.half(), k, v, selection, metadata, SCALE)
    with pytest.raises(ValueError, match="tokens"):
        sparse_prefill(q[:-1], k, v, selection[:, :-1], metadata, SCALE)
