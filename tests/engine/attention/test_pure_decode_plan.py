"""The host-side plans the GPU backend makes per step, against their general (or token-by-token) forms.

``plan_pure_decode`` must equal ``msa.decode_plan.plan_sparse_decode`` on every pure-decode step, and
``dense_page_lists`` must list each request's pages in order; both run on CPU tensors here.
"""

import pytest
import torch

from m3stack.engine.attention.flashinfer_dense import dense_page_lists
from m3stack.engine.attention.pure_decode_plan import plan_pure_decode
from m3stack.engine.msa.decode_plan import DecodePlanBuffers, SparseDecodeShape, plan_sparse_decode
from tests.engine.attention.step_support import step_metadata

BLOCK = 16
SHAPE = SparseDecodeShape(num_q_heads=8, num_kv_heads=2, head_dim=32, index_head_dim=16, block_size=BLOCK,
                          topk=3, local_blocks=1)  # fmt: skip
CPU = torch.device("cpu")


def _decode_metadata(context_lens: list[int], width: int, seed: int):
    """A pure-decode step: request r holds ``context_lens[r]`` tokens and adds one."""
    generator = torch.Generator().manual_seed(seed)
    pages = torch.randperm(len(context_lens) * width + 1, generator=generator)[1:].view(len(context_lens), width)
    step = dict.fromkeys(range(len(context_lens)), 1)
    return step_metadata(step, dict(enumerate(context_lens)), pages, BLOCK)


@pytest.mark.parametrize(
    "context_lens",
    [[0], [15], [16], [47, 48, 49], [0, 1, 31, 32, 33, 100, 5, 17], list(range(0, 128, 9))],
)
def test_pure_decode_plan_equals_the_general_plan(context_lens: list[int]) -> None:
    width = max(-(-(n + 1) // BLOCK) for n in context_lens) + 2
    metadata = _decode_metadata(context_lens, width, seed=len(context_lens))
    count = len(context_lens)
    fast_buffers, general_buffers = DecodePlanBuffers(count, SHAPE, CPU), DecodePlanBuffers(count, SHAPE, CPU)
    fast = plan_pure_decode(metadata, SHAPE, fast_buffers, torch.arange(count, dtype=torch.int32), 3)
    general = plan_sparse_decode(metadata, SHAPE, CPU, buffers=general_buffers, scan_programs_per_sm=3)
    for name in ("num_requests", "num_tokens", "max_query_len", "max_row_pages", "scan_splits"):
        assert getattr(fast, name) == getattr(general, name), name
    for name in ("token_request", "row_indptr", "row_indptr_cpu", "last_page_len", "last_page_len_cpu"):
        fast_value, general_value = getattr(fast, name), getattr(general, name)
        assert fast_value.dtype == general_value.dtype, name
        assert torch.equal(fast_value, general_value), name
    assert fast.page_ids is fast_buffers.page_ids and fast.scan_counters is fast_buffers.scan_counters


def test_pure_decode_plan_refuses_other_steps() -> None:
    metadata = step_metadata({0: 2}, {0: 5}, torch.arange(1, 5).view(1, 4), BLOCK)
    with pytest.raises(ValueError, match="pure-decode"):
        plan_pure_decode(metadata, SHAPE, DecodePlanBuffers(2, SHAPE, CPU), torch.arange(2, dtype=torch.int32), 3)


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
