"""Flatten a ``SchedulerOutput`` into the model's varlen inputs and the per-step ``AttentionMetadata``.

Pure host-side arithmetic (numpy), then one copy per tensor to the device.  Row layout: request r's
new tokens are rows ``query_start_loc[r] : query_start_loc[r + 1]`` in scheduling order; the rows
whose logits are sampled are each sampling request's last row.  Vision embeddings enter as
(row, embedding) pairs: the rows of this step's tokens that fall on an item's embedding positions,
and the matching slice of the item's cached encoder output.
"""

from dataclasses import dataclass

import numpy as np
import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.request import PLACEHOLDER_TOKEN, Request
from m3stack.engine.runtime.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class HostInputs:
    """Everything of a step on the host, before the device copy (numpy, so it is cheap to build and test)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    slot_mapping: np.ndarray  # [T] int64
    page_table: np.ndarray  # [R, max_pages] int32, 0 past each request's pages
    logits_rows: np.ndarray  # [S] int64, one per sampling request
    sampling_requests: list[Request]
    mm_rows: np.ndarray  # [M] int64 rows receiving vision embeddings
    mm_slices: list[tuple[str, torch.Tensor]]  # (content hash, boolean mask over the item's embeddings), in row order
    # Rows whose token a step in flight is still sampling (async scheduling), and whose request each is.
    placeholder_rows: np.ndarray  # [P] int64
    placeholder_requests: list[str]


@dataclass
class StepInputs:
    """The same on the device, ready for ``model.forward`` and the sampler."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_rows: torch.Tensor
    sampling_requests: list[Request]
    mm_rows: torch.Tensor | None
    mm_embeds: torch.Tensor | None


def build_host_inputs(out: SchedulerOutput, block_size: int) -> HostInputs:
    scheduled = out.requests
    num_requests = len(scheduled)
    if num_requests and all(s.num_new_tokens == 1 and s.samples and not s.request.mm_inputs for s in scheduled):
        return _plain_decode_inputs(scheduled, block_size)
    return _mixed_inputs(scheduled, block_size)


def _mixed_inputs(scheduled: list[ScheduledRequest], block_size: int) -> HostInputs:
    num_requests = len(scheduled)
    query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_requests)
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num_requests)
    query_start_loc = np.zeros(num_requests + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = (starts + query_lens).astype(np.int32)
    num_tokens = int(query_start_loc[-1])

    if num_tokens == num_requests:  # plain decode: one token per request, no per-request slicing
        input_ids = np.fromiter((s.request.token_ids[s.start] for s in scheduled), dtype=np.int64, count=num_requests)
        positions = starts
    else:
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for r, item in enumerate(scheduled):
            row = int(query_start_loc[r])
            input_ids[row : row + item.num_new_tokens] = item.request.token_ids[
                item.start : item.start + item.num_new_tokens
            ]
        row_starts = np.repeat(query_start_loc[:-1].astype(np.int64), query_lens)
        positions = np.repeat(starts, query_lens) + np.arange(num_tokens) - row_starts

    pages = -(-seq_lens // block_size)
    page_table = np.zeros((num_requests, int(pages.max()) if num_requests else 0), dtype=np.int32)
    for r, item in enumerate(scheduled):
        page_table[r, : pages[r]] = item.block_ids[: pages[r]]
    request_of_token = np.repeat(np.arange(num_requests), query_lens)
    slot_mapping = (
        page_table[request_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )

    placeholder_rows = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
    placeholder_requests = [scheduled[r].request.request_id for r in request_of_token[placeholder_rows]]
    sampling = [r for r, item in enumerate(scheduled) if item.samples]
    mm_rows: list[np.ndarray] = []
    mm_slices: list[tuple[str, torch.Tensor]] = []
    for r, item in enumerate(scheduled):
        if not item.request.mm_inputs:
            continue
        start, end, row = item.start, item.start + item.num_new_tokens, int(query_start_loc[r])
        for mm in item.request.mm_inputs:
            if mm.last_embed < start or mm.first_embed >= end:
                continue
            mask = (mm.embed_positions >= start) & (mm.embed_positions < end)
            mm_rows.append(mm.embed_positions[mask].numpy() - start + row)
            mm_slices.append((mm.content_hash, mask))
    return HostInputs(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        page_table=page_table,
        logits_rows=query_start_loc[1:][sampling].astype(np.int64) - 1,
        sampling_requests=[scheduled[r].request for r in sampling],
        mm_rows=np.concatenate(mm_rows) if mm_rows else np.empty(0, dtype=np.int64),
        mm_slices=mm_slices,
        placeholder_rows=placeholder_rows,
        placeholder_requests=placeholder_requests,
    )


def _plain_decode_inputs(scheduled: list[ScheduledRequest], block_size: int) -> HostInputs:
    """``build_host_inputs`` of a step where every request adds one token and samples, without images: one
    pass over the requests, then whole-array numpy (the decode steps' share of the host time per step)."""
    num_requests = len(scheduled)
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num_requests)
    input_ids = np.fromiter((s.request.token_ids[s.start] for s in scheduled), dtype=np.int64, count=num_requests)
    pages = starts // block_size + 1
    page_table = np.zeros((num_requests, int(pages.max())), dtype=np.int32)
    for r, item in enumerate(scheduled):
        page_table[r, : pages[r]] = item.block_ids[: pages[r]]
    rows = np.arange(num_requests)
    slot_mapping = page_table[rows, pages - 1].astype(np.int64) * block_size + starts % block_size
    placeholder_rows = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
    return HostInputs(
        input_ids=input_ids,
        positions=starts,
        query_start_loc=np.arange(num_requests + 1, dtype=np.int32),
        seq_lens=(starts + 1).astype(np.int32),
        slot_mapping=slot_mapping,
        page_table=page_table,
        logits_rows=rows,
        sampling_requests=[s.request for s in scheduled],
        mm_rows=np.empty(0, dtype=np.int64),
        mm_slices=[],
        placeholder_rows=placeholder_rows,
        placeholder_requests=[scheduled[r].request.request_id for r in placeholder_rows],
    )


def to_device(host: HostInputs, block_size: int, device: torch.device, encoder_cache: EncoderCache) -> StepInputs:
    def move(array: np.ndarray) -> torch.Tensor:
        return upload(array, device)

    query_start_loc_cpu = torch.from_numpy(host.query_start_loc)
    seq_lens_cpu = torch.from_numpy(host.seq_lens)
    metadata = AttentionMetadata(
        block_size=block_size,
        query_start_loc=move(host.query_start_loc),
        seq_lens=move(host.seq_lens),
        positions=move(host.positions),
        slot_mapping=move(host.slot_mapping),
        page_table=move(host.page_table),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    mm_rows = mm_embeds = None
    if host.mm_slices:
        mm_rows = move(host.mm_rows)
        mm_embeds = torch.cat([encoder_cache.get(key)[upload(mask, device)] for key, mask in host.mm_slices])
    return StepInputs(
        input_ids=move(host.input_ids),
        positions=metadata.positions,
        metadata=metadata,
        logits_rows=move(host.logits_rows),
        sampling_requests=host.sampling_requests,
        mm_rows=mm_rows,
        mm_embeds=mm_embeds,
    )
