"""MSA prefill kernels on the GPU at M3 attention dims (bf16) against the fp32 reference.

A ragged batch (a full prefill that is not a multiple of the block, a prefix + chunk starting and
ending mid-block, a single token) and a long-context chunk (64K cached + 2K new, where the indexer
splits the key range).  Attention is checked on a sample of tokens per request (the reference is
dense); unused cache slots are NaN, so any read of them shows.
"""

import pytest
import torch

from bench.msa_prefill import BLOCK_MAJOR_CONFIGS, INDEX_CONFIGS, MERGE_CONFIGS, describe
from m3stack.engine.msa import reference
from m3stack.engine.msa.prefill_attention import sparse_prefill
from m3stack.engine.msa.prefill_common import PrefillTuning
from m3stack.engine.msa.prefill_index import IndexTuning, prefill_index_topk
from tests.engine.msa.prefill_support import PagedBatch, assert_selection_matches, paged_batch

Q_HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM, BLOCK, TOPK, LOCAL = 64, 4, 128, 128, 128, 16, 1
SCALE = HEAD_DIM**-0.5
SAMPLED_TOKENS = 96
# bf16 products are exact in fp32; the kernel sums 128 of them in another order than the reference.
SCORE_TOLERANCE = 2e-3
OUT_TOLERANCE = 3e-2  # bf16 P, bf16 partials and a bf16 output against an fp32 reference

CASES = {
    "ragged": [(4096 + 77, 4096 + 77), (9000, 1500), (2000, 1)],
    "long-chunk": [(65536, 2048)],
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(len(request.param))
    batch = paged_batch(
        CASES[request.param], num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, index_dim=INDEX_DIM, block_size=BLOCK,
        dtype=torch.bfloat16, device="cuda", generator=generator,
    )  # fmt: skip
    num_tokens = batch.metadata.num_tokens
    q = torch.randn(num_tokens, Q_HEADS, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    index_q = torch.randn(num_tokens, KV_HEADS, INDEX_DIM, generator=generator).to("cuda", torch.bfloat16)
    return batch, q, index_q


def _sampled_rows(start: int, stop: int, generator: torch.Generator) -> torch.Tensor:
    """First, last and random rows of a request, sorted."""
    count = stop - start
    picks = torch.randperm(count, generator=generator)[: SAMPLED_TOKENS - 2]
    return torch.unique(torch.cat([torch.tensor([0, count - 1]), picks])) + start


def _assert_selection_matches_reference(batch: PagedBatch, index_q: torch.Tensor, selection: torch.Tensor) -> None:
    for request, (start, stop) in enumerate(batch.token_ranges):
        positions = batch.request_positions(request)
        expected = reference.index_block_topk(
            index_q[start:stop], batch.index_keys[request], positions, BLOCK, TOPK, LOCAL
        )
        scores = reference.block_scores(index_q[start:stop], batch.index_keys[request], positions, BLOCK)
        assert_selection_matches(selection[:, start:stop], expected, scores, LOCAL, SCORE_TOLERANCE)


def test_selection_matches_reference(case: tuple[PagedBatch, torch.Tensor, torch.Tensor]) -> None:
    batch, _, index_q = case
    selection = prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL)
    _assert_selection_matches_reference(batch, index_q, selection)
    # One pass over the keys, or the key range split over programs and merged: the very same selection.
    for splits in (1, 3):
        tuning = IndexTuning(key_splits=splits)
        assert torch.equal(prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL, tuning),
                           selection)  # fmt: skip


@pytest.mark.parametrize("tuning", INDEX_CONFIGS[1:], ids=describe)
def test_selection_launch_configs(case: tuple[PagedBatch, torch.Tensor, torch.Tensor], tuning: IndexTuning) -> None:
    """Every indexer launch the benchmark sweeps (the default is checked above) selects correctly."""
    batch, _, index_q = case
    selection = prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL, tuning)
    _assert_selection_matches_reference(batch, index_q, selection)


@pytest.mark.parametrize(
    ("method", "tuning"),
    [("block_major", None), ("query_major", None)] + [("block_major", t) for t in BLOCK_MAJOR_CONFIGS[1:]],
    ids=lambda value: describe(value) if isinstance(value, PrefillTuning) else str(value),
)
def test_attention_matches_reference(
    case: tuple[PagedBatch, torch.Tensor, torch.Tensor], method: str, tuning: PrefillTuning | None
) -> None:
    """Both methods with their default launches, and block-major in every launch config the benchmark sweeps."""
    batch, q, index_q = case
    selection = prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL)
    out = sparse_prefill(q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE, method, tuning=tuning)
    assert torch.isfinite(out).all()
    generator = torch.Generator().manual_seed(0)
    for request, (start, stop) in enumerate(batch.token_ranges):
        rows = _sampled_rows(start, stop, generator).to("cuda")
        expected = reference.sparse_attention(
            q[rows], batch.keys[request], batch.values[request], batch.metadata.positions[rows], selection[:, rows],
            BLOCK, SCALE,
        )  # fmt: skip
        torch.testing.assert_close(out[rows].float(), expected, atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)


def test_chunked_workspace_and_hot_block_change_nothing(case: tuple[PagedBatch, torch.Tensor, torch.Tensor]) -> None:
    """A workspace of 600 tokens (several chunks) and a block every token picks (split over many
    work items) give bit-identical rows: each (token, block) partial is computed independently."""
    batch, q, index_q = case
    selection = prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL)
    selection[:, :, 0] = torch.where(selection[:, :, 0] >= 0, 0, selection[:, :, 0])  # block 0 for all
    selection = torch.where((selection == 0).cumsum(-1) > 1, -1, selection)  # no repeats of block 0
    args = (q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE)
    whole = sparse_prefill(*args)
    chunk_bytes = 600 * Q_HEADS * TOPK * (HEAD_DIM * 2 + 4)
    chunked = sparse_prefill(*args, workspace_bytes=chunk_bytes, tuning=PrefillTuning(queries_per_item=32))
    assert torch.equal(whole, chunked)
    query_major = sparse_prefill(*args, method="query_major")
    torch.testing.assert_close(whole.float(), query_major.float(), atol=OUT_TOLERANCE, rtol=OUT_TOLERANCE)


@pytest.mark.parametrize(("warps", "stages", "tokens"), MERGE_CONFIGS[1:], ids=str)
def test_merge_launch_configs_change_nothing(
    case: tuple[PagedBatch, torch.Tensor, torch.Tensor], warps: int, stages: int, tokens: int
) -> None:
    """Every merge launch the benchmark sweeps folds the same partials in the same order: rows equal
    to the default launch's bit for bit (the default is checked against the reference above)."""
    batch, q, index_q = case
    selection = prefill_index_topk(index_q, batch.index_key_cache, batch.metadata, TOPK, LOCAL)
    args = (q, batch.key_cache, batch.value_cache, selection, batch.metadata, SCALE)
    tuning = PrefillTuning(merge_num_warps=warps, merge_num_stages=stages, merge_tokens=tokens)
    assert torch.equal(sparse_prefill(*args), sparse_prefill(*args, tuning=tuning))
