"""The host-side plans the GPU backend makes per step, against token-by-token forms.

``msa.decode_plan.plan_sparse_decode`` must give every (token, KV head) row the pages its position can
select and its own block's key count, on pure-decode steps (its numpy shortcut) and on mixed ones, and
``dense_page_lists`` must list each request's pages in order; both run on CPU tensors here.
"""

import pytest
import torch

from m3stack.engine.attention.flashinfer_dense import dense_page_lists
from m3stack.engine.msa.decode_plan import DecodePlanBuffers, SparseDecodeShape, plan_sparse_decode
from tests.engine.attention.step_support import step_metadata

BLOCK = 16
SHAPE = SparseDecodeShape(num_q_heads=8, num_kv_heads=2, head_dim=32, index_head_dim=16, block_size=BLOCK,
                          topk=3, local_blocks=1)  # fmt: skip
CPU = torch.device("cpu")


def _metadata(step: dict[int, int], context_lens: list[int], width: int, seed: int):
    """Request r holds ``context_lens[r]`` tokens and adds ``step[r]``."""
    generator = torch.Generator().manual_seed(seed)
    pages = torch.randperm(len(context_lens) * width + 1, generator=generator)[1:].view(len(context_lens), width)
    return step_metadata(step, dict(enumerate(context_lens)), pages, BLOCK)


def _expected_rows(step: dict[int, int], context_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Token by token: its request, and per KV head its page count and the keys in its own block."""
    requests, pages, last_lens = [], [], []
    for request, new in step.items():
        for position in range(context_lens[request], context_lens[request] + new):
            requests.append(request)
            for _ in range(SHAPE.num_kv_heads):
                pages.append(min(position // BLOCK + 1, SHAPE.topk))
                last_lens.append(position % BLOCK + 1)
    return requests, pages, last_lens


@pytest.mark.parametrize(
    "context_lens, new_tokens",
    [
        ([0], [1]),
        ([15], [1]),
        ([16], [1]),
        ([47, 48, 49], [1, 1, 1]),
        ([0, 1, 31, 32, 33, 100, 5, 17], [1] * 8),
        (list(range(0, 128, 9)), [1] * 15),
        ([47, 0, 33], [3, 1, 2]),  # mixed: more than one new token for some requests
    ],
)
@pytest.mark.parametrize("with_buffers", [False, True])
def test_decode_plan_lists_each_row_s_pages(context_lens: list[int], new_tokens: list[int], with_buffers: bool):
    step = dict(enumerate(new_tokens))
    width = max(-(-(n + k) // BLOCK) for n, k in zip(context_lens, new_tokens, strict=True)) + 2
    metadata = _metadata(step, context_lens, width, seed=len(context_lens))
    count = sum(new_tokens)
    buffers = DecodePlanBuffers(count, SHAPE, CPU) if with_buffers else None
    plan = plan_sparse_decode(metadata, SHAPE, CPU, buffers=buffers, scan_programs_per_sm=3)
    requests, pages, last_lens = _expected_rows(step, context_lens)
    assert (plan.num_requests, plan.num_tokens, plan.max_query_len) == (len(step), count, max(new_tokens))
    assert plan.token_request.tolist() == requests
    assert plan.row_indptr_cpu.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
    assert plan.row_indptr.tolist() == plan.row_indptr_cpu.tolist()
    assert plan.last_page_len.tolist() == plan.last_page_len_cpu.tolist() == last_lens
    for name in ("token_request", "row_indptr", "row_indptr_cpu", "last_page_len", "last_page_len_cpu"):
        assert getattr(plan, name).dtype == torch.int32, name
    assert plan.max_row_pages == min(SHAPE.topk, width)
    if buffers is not None:  # the plan's device tensors are the buffers a CUDA graph replays over
        assert plan.page_ids is buffers.page_ids and plan.row_indptr is buffers.row_indptr


def test_dense_page_lists_list_every_request_s_pages_in_order() -> None:
    step, done = {0: 1, 1: 5, 2: 1}, {0: 0, 1: 40, 2: 16}
    pages = torch.randperm(30, generator=torch.Generator().manual_seed(1)).view(3, 10)
    metadata = step_metadata(step, done, pages, BLOCK)
    indptr, indices, last_page_len = dense_page_lists(metadata, BLOCK)
    expected, bounds, last = [], [0], []
    for r in range(3):
        seq_len = done[r] + step[r]
        count = -(-seq_len // BLOCK)
        expected += pages[r, :count].tolist()
        bounds.append(bounds[-1] + count)
        last.append(seq_len - (count - 1) * BLOCK)
    assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
    assert indptr.tolist() == bounds and indices.tolist() == expected and last_page_len.tolist() == last
