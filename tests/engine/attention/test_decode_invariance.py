"""A decode row's attention does not depend on the rest of its step (Triton paths, interpreted on CPU).

Decode steps replayed from CUDA graphs run a padded batch over the page table's full width (``max_model_len``),
eager ones the real batch over its own widest request; in half precision a row's output changes with how its pages
are sliced over programs (each slice's softmax weights are rounded to the cache's dtype against that slice's
running maximum), so the slicing must follow the row alone.  On the H200 the MXFP8 tiny model's greedy tokens
differed between the two (tests/gpu/test_mxfp8.py) while the float32 engine's, which rounds nothing there, agreed.
fp16: the interpreter multiplies bf16 as raw bits.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import numpy as np
import torch

from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.runtime.cuda_graphs import PaddedDecodeBuffers
from m3stack.engine.runtime.inputs import HostInputs
from tests.engine.attention.step_support import step_metadata

BLOCK, HQ, HKV, HEAD_DIM = 16, 8, 2, 32
CONTEXTS = (250, 40, 150, 700)  # cached tokens of each request before this decode step: 16, 3, 10 and 44 pages
MAX_MODEL_LEN = 2048  # the graphs' page table: 128 pages a row
NUM_PAGES = 80


def _dense_caches(generator: torch.Generator) -> list:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=None,
                       sparse_layers=(False,), dtype=torch.float16)  # fmt: skip
    (layer,) = allocate_kv_cache(spec, NUM_PAGES, "cpu")
    for tensor in (layer.key, layer.value):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(torch.float16))
    layer.key[0].fill_(float("nan"))  # the null page: only padding rows may read it
    layer.value[0].fill_(float("nan"))
    return [layer]


def _host_inputs(requests: list[int], pages: torch.Tensor) -> HostInputs:
    """The decode step of ``requests`` (one new token each, after ``CONTEXTS``) as the runtime stages it."""
    positions = np.array([CONTEXTS[r] for r in requests], dtype=np.int64)
    table = pages[requests].numpy()
    slots = table[np.arange(len(requests)), positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    empty = np.zeros(0, dtype=np.int64)
    return HostInputs(input_ids=np.zeros(len(requests), dtype=np.int64), positions=positions,
                      query_start_loc=np.arange(len(requests) + 1, dtype=np.int32),
                      seq_lens=(positions + 1).astype(np.int32), slot_mapping=slots, page_table=table,
                      logits_rows=np.arange(len(requests), dtype=np.int64), sampling_requests=[], mm_rows=empty,
                      mm_slices=[], placeholder_rows=empty, placeholder_requests=[])  # fmt: skip


def test_a_decode_rows_dense_attention_is_the_same_alone_in_a_batch_and_in_a_padded_graph_batch() -> None:
    generator = torch.Generator().manual_seed(5)
    caches = _dense_caches(generator)
    backend = GpuAttentionBackend(caches, topk_blocks=4, local_blocks=1, num_q_heads=HQ)
    reference = ReferenceAttentionBackend(caches, topk_blocks=4, local_blocks=1)
    # Each request's pages, scattered over the pool (page 0 is the null page); a row's width: its context's pages.
    pages = torch.zeros(len(CONTEXTS), max(c // BLOCK + 1 for c in CONTEXTS), dtype=torch.int32)
    pool = 1 + torch.randperm(NUM_PAGES - 1, generator=generator)
    used = 0
    for request, context in enumerate(CONTEXTS):
        count = context // BLOCK + 1  # the new token's page included
        pages[request, :count] = pool[used : used + count].to(torch.int32)
        used += count
    q, k, v = (torch.randn(len(CONTEXTS), heads, HEAD_DIM, generator=generator).to(torch.float16)
               for heads in (HQ, HKV, HKV))  # fmt: skip

    def eager(requests: list[int]) -> torch.Tensor:
        """The step as an eager decode runs it: its own requests, the page table as wide as its widest one."""
        done = {r: CONTEXTS[r] for r in requests}
        width = max(CONTEXTS[r] // BLOCK + 1 for r in requests)
        metadata = step_metadata(dict.fromkeys(requests, 1), done, pages[:, :width], BLOCK)
        backend.begin_step(metadata)
        return backend.dense(0, q[requests], k[requests], v[requests])

    buffers = PaddedDecodeBuffers(torch.device("cpu"), block_size=BLOCK, max_batch=8, max_model_len=MAX_MODEL_LEN)

    def graphed(requests: list[int], size: int) -> torch.Tensor:
        """The step as a CUDA-graph replay runs it: padded to ``size`` rows over the buffers' full-width table."""
        metadata = buffers.stage(_host_inputs(requests, pages), size)
        backend.begin_step(metadata)
        pad = size - len(requests)
        padded = [torch.cat([x[requests], torch.zeros(pad, *x.shape[1:], dtype=x.dtype)]) for x in (q, k, v)]
        return backend.dense(0, *padded)[: len(requests)]

    batch = [0, 1, 2, 3]
    together = eager(batch)
    expected = torch.cat([eager([r]) for r in batch])
    assert torch.equal(together, expected)
    assert torch.equal(graphed(batch, 8), expected)
    assert torch.equal(graphed([2, 0, 1], 4), expected[[2, 0, 1]])
    # And it is the attention: the reference backend's over the same cache, within half precision.
    reference.begin_step(step_metadata(dict.fromkeys(batch, 1), dict(zip(batch, CONTEXTS, strict=True)), pages,
                                       BLOCK))  # fmt: skip
    torch.testing.assert_close(expected.float(), reference.dense(0, q, k, v).float(), atol=3e-3, rtol=3e-3)
