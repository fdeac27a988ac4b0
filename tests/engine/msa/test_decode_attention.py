"""Sparse decode attention (Triton split-K fallback) and the dense paged mode, against the reference.

FlashInfer (the GPU path) is not installed here; tests/gpu/test_msa_decode.py covers it on the H200.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest
import torch

from m3stack.engine.msa import reference
from m3stack.engine.msa.decode_attention import sparse_decode_attention
from m3stack.engine.msa.decode_index import decode_index_topk
from m3stack.engine.msa.decode_plan import SparseDecodeShape, plan_sparse_decode, token_positions_cpu
from m3stack.engine.msa.paged_attention import PageRows, paged_attention
from tests.engine.msa.prefill_support import PagedBatch, paged_batch

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
    for request, (start, stop) in enumerate(batch.token_ranges):
        expected = reference.sparse_attention(
            q[start:stop], batch.keys[request], batch.values[request], batch.request_positions(request),
            selected[:, start:stop], BLOCK, SCALE,
        )  # fmt: skip
        torch.testing.assert_close(out[start:stop].float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("pages_per_split", [None, 2])
def test_dense_paged_attention_matches_reference(pages_per_split: int | None) -> None:
    """Dense layers' fallback: causal attention over every cached page, decode and prefill rows."""
    batch, q = make_batch(torch.float32, [(45, 19), (83, 3), (40, 1)], seed=8)
    metadata = batch.metadata
    request, positions = token_positions_cpu(metadata)
    rows = PageRows(token_request=request.to(torch.int32), positions=metadata.positions, page_table=metadata.page_table,
                    row_indptr=None, page_ids=None, last_len=None,
                    max_pages=int(positions.max()) // BLOCK + 1)  # fmt: skip
    out = paged_attention(q, batch.key_cache, batch.value_cache, rows, SCALE, pages_per_split=pages_per_split,
                          out=poisoned_like(q))  # fmt: skip
    for index, (start, stop) in enumerate(batch.token_ranges):
        expected = reference.dense_causal_attention(
            q[start:stop], batch.keys[index], batch.values[index], batch.request_positions(index), SCALE
        )
        torch.testing.assert_close(out[start:stop], expected, atol=2e-5, rtol=2e-5)


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
