"""The MSA decode plan of a pure-decode step (one new token per request), from numpy on the host.

``msa.decode_plan.plan_sparse_decode`` plans any decode-like step with some twenty small torch CPU
operations and three staged copies (~0.35 ms a step on a CPU core, measured with
``bench.engine_prepare``), most of which a pure-decode step does not need: its token ``r`` is request
``r`` at position ``seq_len - 1``.  This plans the same step with a handful of numpy operations into
the batch size's ``DecodePlanBuffers``; ``tests/engine/attention/test_pure_decode_plan.py`` checks it
equals ``plan_sparse_decode`` field by field.
"""

import numpy as np
import torch

from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.msa.decode_plan import (
    MAX_SCAN_SPLITS,
    DecodePlanBuffers,
    SparseDecodePlan,
    SparseDecodeShape,
    default_scan_splits,
)


def plan_pure_decode(
    metadata: AttentionMetadata,
    shape: SparseDecodeShape,
    buffers: DecodePlanBuffers,
    token_request_cpu: torch.Tensor,
    scan_programs_per_sm: int,
) -> SparseDecodePlan:
    """``plan_sparse_decode(metadata, shape, device, buffers=buffers, ...)`` for a pure-decode step.

    ``token_request_cpu`` is ``arange(R)`` int32 on the host (kept by the caller, it never changes).
    """
    if not metadata.is_pure_decode:
        raise ValueError("plan_pure_decode plans pure-decode steps only (one new token per request)")
    if metadata.block_size != shape.block_size:
        raise ValueError(f"metadata.block_size {metadata.block_size} differs from the model's {shape.block_size}")
    num_requests, heads = metadata.num_requests, shape.num_kv_heads
    positions = metadata.seq_lens_cpu.numpy().astype(np.int32) - 1
    pages_per_token = np.minimum(positions // shape.block_size + 1, shape.topk)
    row_indptr = np.zeros(num_requests * heads + 1, dtype=np.int32)
    np.cumsum(np.repeat(pages_per_token, heads), out=row_indptr[1:])
    last_page_len = np.repeat(positions % shape.block_size + 1, heads)
    width = metadata.page_table.shape[1]
    scan_splits = default_scan_splits(num_requests, max(0, width - shape.local_blocks), buffers.page_ids.device,
                                      scan_programs_per_sm)  # fmt: skip
    if not 1 <= scan_splits <= MAX_SCAN_SPLITS:
        raise ValueError(f"scan_splits must be in [1, {MAX_SCAN_SPLITS}], got {scan_splits}")
    row_indptr_cpu, last_page_len_cpu = torch.from_numpy(row_indptr), torch.from_numpy(last_page_len)
    buffers.fill(token_request_cpu, row_indptr_cpu, last_page_len_cpu)
    return SparseDecodePlan(
        shape=shape,
        num_requests=num_requests,
        num_tokens=num_requests,
        max_query_len=1,
        token_request=buffers.token_request,
        row_indptr=buffers.row_indptr,
        row_indptr_cpu=row_indptr_cpu,
        last_page_len=buffers.last_page_len,
        last_page_len_cpu=last_page_len_cpu,
        page_ids=buffers.page_ids,
        max_row_pages=min(shape.topk, width),
        scan_splits=scan_splits,
        scan_counters=buffers.scan_counters,
        attention_counters=buffers.attention_counters,
    )
