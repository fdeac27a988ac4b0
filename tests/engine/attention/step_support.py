"""Shared by the attention-backend tests (CPU and GPU): the ``AttentionMetadata`` of one engine step."""

import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata


def step_metadata(
    step: dict[int, int], done: dict[int, int], pages: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """Metadata for ``step`` (``{request: new tokens}``) after ``done`` (``{request: cached tokens}``);
    request r's logical block i lives in page ``pages[r, i]``.  Tensors go to ``pages``' device."""
    device = pages.device
    requests = sorted(step)
    query_lens = torch.tensor([step[r] for r in requests], dtype=torch.int32)
    seq_lens = torch.tensor([done[r] + step[r] for r in requests], dtype=torch.int32)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    positions = torch.cat([torch.arange(done[r], done[r] + step[r]) for r in requests]).to(device)
    owner = torch.repeat_interleave(torch.tensor(requests), query_lens.long()).to(device)
    slot_mapping = pages[owner, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(
        block_size=block_size,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        positions=positions,
        slot_mapping=slot_mapping,
        page_table=pages[requests].to(torch.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
