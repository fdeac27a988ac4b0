"""Prefill over host blocks: gather the pages one request's chunk selected into a compact working set.

A prefill chunk's tokens select many blocks (each token its own top-k), far more than a hot buffer
holds, and a chunk is long enough that one host synchronization per MSA layer costs nothing next to
its attention.  So for each request with host blocks, per MSA layer: the distinct blocks its rows
selected (a ``torch.unique``), their K/V gathered into a fresh ``[2, n, Hkv, B, D]`` tensor (device
pages copied on the device, host pages straight from pinned memory by ``page_copy``), and a one-row
page table mapping each selected block to its place there.  The sparse prefill kernels then run on
that working set exactly as on the cache: same blocks, same keys, same order of selection.
"""

from dataclasses import dataclass

import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.offload.page_copy import copy_pages


@dataclass
class WorkingSet:
    key: torch.Tensor  # [n, Hkv, B, D]
    value: torch.Tensor  # [n, Hkv, B, D]
    page_table: torch.Tensor  # [1, width] int32: logical block -> page of the working set (0 if unselected)
    host_pages: int  # pages read from host memory


def gather_working_set(
    selection: torch.Tensor,
    page_row: torch.Tensor,
    num_device: int,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    torch_only: bool = False,
) -> WorkingSet:
    """The pages ``selection`` (``[Hkv, T, K]`` logical blocks of one request, -1 unused) names through
    ``page_row`` (its page table row); ``device_kv`` / ``host_kv`` are one MSA layer's ``[2, pages, ...]``."""
    blocks = torch.unique(selection[selection >= 0].long())
    pages = page_row[blocks].long()
    count = blocks.numel()
    working = torch.empty((2, count, *device_kv.shape[2:]), dtype=device_kv.dtype, device=device_kv.device)
    on_device = pages < num_device
    device_rows = on_device.nonzero().flatten()
    working[:, device_rows] = device_kv[:, pages[device_rows]]
    host_rows = (~on_device).nonzero().flatten()
    if host_rows.numel():
        host_slots = (pages[host_rows] - num_device).to(torch.int32)
        copy_pages(host_kv, working, host_slots, host_rows.to(torch.int32), torch_only=torch_only)
    table = torch.zeros((1, page_row.numel()), dtype=torch.int32, device=page_row.device)
    table[0, blocks] = torch.arange(count, dtype=torch.int32, device=page_row.device)
    return WorkingSet(working[0], working[1], table, int(host_rows.numel()))


def request_metadata(metadata: AttentionMetadata, request: int, page_table: torch.Tensor) -> AttentionMetadata:
    """The step's metadata cut down to one request, over ``page_table``."""
    start, end = (int(x) for x in metadata.query_start_loc_cpu[request : request + 2])
    device = metadata.query_start_loc.device
    starts = torch.tensor([0, end - start], dtype=torch.int32)
    return AttentionMetadata(
        block_size=metadata.block_size,
        query_start_loc=upload(starts, device),
        seq_lens=metadata.seq_lens[request : request + 1],
        positions=metadata.positions[start:end],
        slot_mapping=metadata.slot_mapping[start:end],
        page_table=page_table,
        query_start_loc_cpu=starts,
        seq_lens_cpu=metadata.seq_lens_cpu[request : request + 1],
    )
