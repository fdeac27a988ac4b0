"""The Triton prefill indexer against the fp32 reference, on CPU under the Triton interpreter.

(The interpreter's ``tl.dot`` multiplies bfloat16 operands as raw integers, so CPU runs use float32
and float16; bfloat16 runs in the GPU suite.)
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.msa import reference
from m3stack.engine.msa.prefill_index import IndexTuning, prefill_index_topk
from m3stack.engine.msa.prefill_plan import token_tiles
from tests.engine.msa.prefill_support import PagedBatch, assert_selection_matches, paged_batch, with_fp8_index

BLOCK = 16
HEADS = 2
INDEX_DIM = 16
# A full prefill whose length is not a multiple of the block, a prefix + chunk that starts and ends
# mid-block, and a single decode-like token: one ragged batch.
REQUESTS = [(100, 100), (83, 21), (40, 1)]


def _batch(dtype: torch.dtype, seed: int) -> tuple[PagedBatch, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = paged_batch(
        REQUESTS, num_kv_heads=HEADS, head_dim=16, index_dim=INDEX_DIM, block_size=BLOCK, dtype=dtype,
        device="cpu", generator=generator,
    )  # fmt: skip
    index_q = torch.randn(batch.metadata.num_tokens, HEADS, INDEX_DIM, generator=generator).to(dtype)
    return batch, index_q


@pytest.fixture(scope="module", params=[torch.float32, torch.float16], ids=["fp32", "fp16"])
def batch(request: pytest.FixtureRequest) -> tuple[PagedBatch, torch.Tensor]:
    return _batch(request.param, seed=len(str(request.param)))


def _check_against_reference(
    batch: PagedBatch,
    index_q: torch.Tensor,
    selection: torch.Tensor,
    topk: int,
    local_blocks: int,
    tolerance: float | None = None,
) -> None:
    assert selection.dtype == torch.int32
    assert selection.shape == (HEADS, batch.metadata.num_tokens, topk)
    # fp16 products are exact in fp32, only the summation order differs from the reference.
    if tolerance is None:
        tolerance = 0.0 if index_q.dtype == torch.float32 else 1e-5
    for request, (start, stop) in enumerate(batch.token_ranges):
        positions = batch.request_positions(request)
        expected = reference.index_block_topk(
            index_q[start:stop], batch.index_keys[request], positions, BLOCK, topk, local_blocks
        )
        scores = reference.block_scores(index_q[start:stop], batch.index_keys[request], positions, BLOCK)
        assert_selection_matches(selection[:, start:stop], expected, scores, local_blocks, tolerance)


@pytest.mark.parametrize("key_splits", [1, 3], ids=["one-pass", "split-keys"])
def test_selection_matches_reference(batch: tuple[PagedBatch, torch.Tensor], key_splits: int) -> None:
    paged, index_q = batch
    tuning = IndexTuning(tile_tokens=8, key_splits=key_splits)
    selection = prefill_index_topk(index_q, paged.index_key_cache, paged.metadata, 4, 1, tuning)
    _check_against_reference(paged, index_q, selection, topk=4, local_blocks=1)


@pytest.mark.parametrize("key_splits", [1, 3], ids=["one-pass", "split-keys"])
def test_scaled_fp8_index_keys_select_what_the_reference_selects_from_the_dequantized_keys(key_splits: int) -> None:
    paged, index_q = _batch(torch.float32, seed=41)
    paged = with_fp8_index(paged)
    tuning = IndexTuning(tile_tokens=8, key_splits=key_splits)
    selection = prefill_index_topk(index_q, paged.index_key_cache, paged.metadata, 4, 1, tuning,
                                   index_key_scale=paged.index_key_scale)  # fmt: skip
    # The kernel scales each key's dot product, the reference dots the scaled key: fp32 roundings differ.
    _check_against_reference(paged, index_q, selection, topk=4, local_blocks=1, tolerance=1e-4)


def test_two_local_blocks_and_wide_topk() -> None:
    """topk wider than most rows' history (-1 padding) and two forced local blocks."""
    paged, index_q = _batch(torch.float32, seed=7)
    selection = prefill_index_topk(index_q, paged.index_key_cache, paged.metadata, 6, 2, IndexTuning(tile_tokens=16))
    _check_against_reference(paged, index_q, selection, topk=6, local_blocks=2)


def test_ties_go_to_the_lower_block() -> None:
    """Identical keys in every block: all block scores tie, so the earliest blocks must win."""
    paged, index_q = _batch(torch.float32, seed=3)
    for request, keys in enumerate(paged.index_keys):
        pages = paged.metadata.page_table[request]
        same = torch.randn(BLOCK, INDEX_DIM)
        for block in range(-(-keys.shape[0] // BLOCK)):
            paged.index_key_cache[pages[block]] = same
            keys[block * BLOCK : (block + 1) * BLOCK] = same[: keys.shape[0] - block * BLOCK]
    selection = prefill_index_topk(index_q, paged.index_key_cache, paged.metadata, 4, 1, IndexTuning(tile_tokens=8))
    _check_against_reference(paged, index_q, selection, topk=4, local_blocks=1)
    stop = paged.token_ranges[0][1]
    last = selection[:, stop - 1]  # position 99, block 6: ranked 0, 1, 2, then the local block
    assert last.tolist() == [[0, 1, 2, 6]] * HEADS


def test_bad_inputs_are_rejected() -> None:
    paged, index_q = _batch(torch.float32, seed=1)
    cache, metadata = paged.index_key_cache, paged.metadata
    with pytest.raises(ValueError, match="local_blocks"):
        prefill_index_topk(index_q, cache, metadata, 4, 0)
    with pytest.raises(ValueError, match="local_blocks"):
        prefill_index_topk(index_q, cache, metadata, 2, 3)
    with pytest.raises(ValueError, match="head dim"):
        prefill_index_topk(index_q[..., :8], cache, metadata, 4, 1)
    with pytest.raises(ValueError, match="tokens"):
        prefill_index_topk(index_q[:-1], cache, metadata, 4, 1)
    with pytest.raises(ValueError, match="float16 but"):
        prefill_index_topk(index_q.half(), cache, metadata, 4, 1)
    with pytest.raises(ValueError, match="block_size"):
        prefill_index_topk(index_q, cache.view(-1, BLOCK // 2, INDEX_DIM), metadata, 4, 1)


def test_token_tiles_cover_each_token_once_longest_first() -> None:
    paged, _ = _batch(torch.float32, seed=2)
    metadata = paged.metadata
    tiles = token_tiles(metadata, 8, torch.device("cpu"))
    request, first, end = tiles.table.tolist()
    covered = [row for lo, hi in zip(first, end, strict=True) for row in range(lo, hi)]
    assert sorted(covered) == list(range(metadata.num_tokens))
    for r, lo, hi in zip(request, first, end, strict=True):
        start, stop = paged.token_ranges[r]
        assert start <= lo < hi <= stop and hi - lo <= 8
    last_positions = [int(metadata.positions[hi - 1]) for hi in end]
    assert last_positions == sorted(last_positions, reverse=True)
