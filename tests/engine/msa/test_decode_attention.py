"""Sparse decode attention (Triton split-K fallback) and the dense paged mode, against the reference.

FlashInfer (the GPU path) is not installed here; tests/gpu/test_msa_decode.py covers it on the H200.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.msa import reference
from m3stack.engine.msa.decode_attention import TritonDecodeConfig, sparse_decode_attention
from m3stack.engine.msa.decode_fused import select_and_attend
from m3stack.engine.msa.decode_index import ScanConfig, decode_index_topk, scan_index_pages
from m3stack.engine.msa.decode_plan import SparseDecodeShape, plan_sparse_decode, token_positions_cpu
from m3stack.engine.msa.paged_attention import PageRows, paged_attention
from tests.engine.msa.prefill_support import PagedBatch, paged_batch, with_fp8_kv

BLOCK, HKV, HQ, HEAD_DIM, INDEX_DIM = 16, 2, 8, 32, 16
SCALE = HEAD_DIM**-0.5
REQUESTS = [(250, 1), (37, 1), (16, 1), (130, 3), (9, 2)]
SHAPE = SparseDecodeShape(num_q_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, index_head_dim=INDEX_DIM,
                          block_size=BLOCK, topk=4, local_blocks=1)  # fmt: skip


def make_batch(dtype: torch.dtype, requests: list[tuple[int, int]], seed: int) -> tuple[PagedBatch, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch = paged_batch(requests, num_kv_heads=HKV, head_dim=HEAD_DIM, index_dim=INDEX_DIM, block_size=BLOCK,
                        dtype=dtype, device="cpu", generator=generator)  # fmt: skip
    q = torch.randn(batch.metadata.num_tokens, HQ, HEAD_DIM, generator=generator).to(dtype)
    return batch, q


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def assert_attends(batch: PagedBatch, q: torch.Tensor, selected: torch.Tensor, out: torch.Tensor,
                   dtype: torch.dtype) -> None:  # fmt: skip
    """``out`` is the reference's attention of each request's tokens over the ``selected`` blocks."""
    for request, (start, stop) in enumerate(batch.token_ranges):
        expected = reference.sparse_attention(
            q[start:stop], batch.keys[request], batch.values[request], batch.request_positions(request),
            selected[:, start:stop], BLOCK, SCALE,
        )  # fmt: skip
        torch.testing.assert_close(out[start:stop].float(), expected, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "pages_per_split"), [(torch.float32, None), (torch.float32, 1), (torch.float16, 3)],
                         ids=["fp32-auto", "fp32-page-splits", "fp16-3-page-splits"])  # fmt: skip
def test_sparse_decode_matches_reference(dtype: torch.dtype, pages_per_split: int | None) -> None:
    batch, q = make_batch(dtype, REQUESTS, seed=21)
    metadata = batch.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cpu"))
    index_q = torch.randn(metadata.num_tokens, HKV, INDEX_DIM).to(dtype)
    selected = decode_index_topk(index_q, batch.index_key_cache, metadata, plan)
    out = poisoned_like(q)
    if pages_per_split is None:
        sparse_decode_attention(q, batch.key_cache, batch.value_cache, plan, metadata.positions, metadata.page_table,
                                SCALE, out=out)  # fmt: skip
    else:
        from m3stack.engine.msa.decode_attention import sparse_rows

        rows = sparse_rows(plan, metadata.positions, metadata.page_table)
        paged_attention(q, batch.key_cache, batch.value_cache, rows, SCALE, pages_per_split=pages_per_split, out=out)
    assert_attends(batch, q, selected, out, dtype)


@pytest.mark.parametrize(("pages_per_split", "row_slices"), [(None, 0), (2, 0), (1, 3), (2, 2)])
def test_dense_paged_attention_matches_reference(pages_per_split: int | None, row_slices: int) -> None:
    """Dense layers' fallback: causal attention over every cached page, decode and prefill rows; slices of one size
    for every row, or (``row_slices``) cut from each row's own pages."""
    batch, q = make_batch(torch.float32, [(45, 19), (83, 3), (40, 1)], seed=8)
    metadata = batch.metadata
    request, positions = token_positions_cpu(metadata)
    rows = PageRows(token_request=request.to(torch.int32), positions=metadata.positions, page_table=metadata.page_table,
                    row_indptr=None, page_ids=None, last_len=None,
                    max_pages=int(positions.max()) // BLOCK + 1)  # fmt: skip
    out = paged_attention(q, batch.key_cache, batch.value_cache, rows, SCALE, pages_per_split=pages_per_split,
                          out=poisoned_like(q), row_slices=row_slices)  # fmt: skip
    for index, (start, stop) in enumerate(batch.token_ranges):
        expected = reference.dense_causal_attention(
            q[start:stop], batch.keys[index], batch.values[index], batch.request_positions(index), SCALE
        )
        torch.testing.assert_close(out[start:stop], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("dtype", "scan_splits", "pages_per_split"),
    [(torch.float32, None, None), (torch.float32, 3, 1), (torch.float16, 1, 2)],
    ids=["fp32-auto", "fp32-3-scan-splits-page-splits", "fp16-one-scan-split-2-page-splits"],
)
def test_attention_that_merges_the_scans_lists_itself(dtype: torch.dtype, scan_splits: int | None,
                                                      pages_per_split: int | None) -> None:  # fmt: skip
    """``select_and_attend`` over an unmerged scan: the merge launch's selection and page ids, and the reference's
    attention over them, with every split of a row merging the row's lists itself."""
    batch, q = make_batch(dtype, REQUESTS, seed=33)
    metadata = batch.metadata
    index_q = torch.randn(metadata.num_tokens, HKV, INDEX_DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    merged_plan = plan_sparse_decode(metadata, SHAPE, torch.device("cpu"), scan_splits=scan_splits)
    want_selected = decode_index_topk(index_q, batch.index_key_cache, metadata, merged_plan)
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cpu"), scan_splits=scan_splits)
    plan.page_ids.fill_(-7)
    scan = scan_index_pages(index_q, batch.index_key_cache, metadata, plan, ScanConfig(fused_merge=False))
    scan.selected.fill_(-7)
    out = select_and_attend(q, batch.key_cache, batch.value_cache, scan, metadata, plan, SCALE,
                            TritonDecodeConfig(pages_per_split=pages_per_split), out=poisoned_like(q))  # fmt: skip
    assert torch.equal(scan.selected, want_selected)
    assert torch.equal(plan.page_ids, merged_plan.page_ids)
    assert not plan.attention_counters.any()  # the combine tickets are left at zero for the next layer
    assert_attends(batch, q, want_selected, out, dtype)


@pytest.mark.parametrize("merge_in_attention", [False, True], ids=["paged-attention", "select-and-attend"])
def test_an_fp8_kv_cache_is_read_as_the_values_it_holds(merge_in_attention: bool) -> None:
    """Sparse decode over an fp8 (e4m3) KV cache: tiles widened exactly, attention in the queries' dtype."""
    batch, q = make_batch(torch.float32, REQUESTS, seed=43)
    batch = with_fp8_kv(batch)
    metadata = batch.metadata
    index_q = torch.randn(metadata.num_tokens, HKV, INDEX_DIM, generator=torch.Generator().manual_seed(6))
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cpu"))
    out = poisoned_like(q)
    if merge_in_attention:
        scan = scan_index_pages(index_q, batch.index_key_cache, metadata, plan, ScanConfig(fused_merge=False))
        select_and_attend(q, batch.key_cache, batch.value_cache, scan, metadata, plan, SCALE, out=out)
        selected = scan.selected
    else:
        selected = decode_index_topk(index_q, batch.index_key_cache, metadata, plan)
        sparse_decode_attention(q, batch.key_cache, batch.value_cache, plan, metadata.positions, metadata.page_table,
                                SCALE, out=out)  # fmt: skip
    assert_attends(batch, q, selected, out, torch.float32)


def test_attention_that_merges_refuses_a_merged_scan() -> None:
    batch, q = make_batch(torch.float32, [(40, 1)], seed=1)
    plan = plan_sparse_decode(batch.metadata, SHAPE, torch.device("cpu"))
    index_q = torch.randn(1, HKV, INDEX_DIM)
    scan = scan_index_pages(index_q, batch.index_key_cache, batch.metadata, plan, ScanConfig())
    with pytest.raises(ValueError, match="already merged"):
        select_and_attend(q, batch.key_cache, batch.value_cache, scan, batch.metadata, plan, SCALE)


def test_bad_input_is_rejected() -> None:
    batch, q = make_batch(torch.float32, [(40, 1)], seed=1)
    metadata = batch.metadata
    plan = plan_sparse_decode(metadata, SHAPE, torch.device("cpu"))
    args = (metadata.positions, metadata.page_table, SCALE)
    with pytest.raises(ValueError, match="q has shape"):
        sparse_decode_attention(q[:, :4], batch.key_cache, batch.value_cache, plan, *args)
    with pytest.raises(ValueError, match=r"q is torch\.float16"):
        sparse_decode_attention(q.half(), batch.key_cache, batch.value_cache, plan, *args)
    with pytest.raises(ValueError, match="out must be"):
        sparse_decode_attention(q, batch.key_cache, batch.value_cache, plan, *args, out=q[:, :2])
