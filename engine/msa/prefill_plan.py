"""Host-side planning shared by the MSA prefill kernels: token tiles, per-token requests, global blocks.

Everything here is derived from host-known lengths (``query_start_loc_cpu``, ``seq_lens_cpu``) or
computed on the device with grids sized from them, so planning never waits for the GPU.
"""

from dataclasses import dataclass

import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata


def check_paged_layout(block_size: int, num_tokens: int, metadata: AttentionMetadata, what: str) -> None:
    """``what`` (a cache or a query tensor's name) must match the step's block size and token count."""
    if block_size != metadata.block_size:
        raise ValueError(f"{what} pages hold {block_size} tokens, metadata.block_size is {metadata.block_size}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if num_tokens != metadata.num_tokens:
        raise ValueError(f"{what} is for {num_tokens} tokens, metadata has {metadata.num_tokens}")


@dataclass(frozen=True)
class TokenTiles:
    """Runs of at most ``tile_tokens`` consecutive new tokens of one request.

    ``table`` is ``[3, count]`` int32 on the device: request, first token row, one past the last
    row.  Tiles are ordered by the position of their last token, highest first, so that in a
    causal workload the longest programs start first and the short ones fill the tail.
    """

    table: torch.Tensor
    count: int


def token_tiles(metadata: AttentionMetadata, tile_tokens: int, device: torch.device) -> TokenTiles:
    starts = metadata.query_start_loc_cpu.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    tiles_per_request = (query_lens + tile_tokens - 1) // tile_tokens
    count = int(tiles_per_request.sum())
    if count == 0:
        return TokenTiles(torch.empty((3, 0), dtype=torch.int32, device=device), 0)
    request = torch.repeat_interleave(torch.arange(len(query_lens)), tiles_per_request)
    first_tile = torch.cumsum(tiles_per_request, 0) - tiles_per_request
    index_in_request = torch.arange(count) - first_tile[request]
    first_row = starts[request] + index_in_request * tile_tokens
    end_row = torch.minimum(first_row + tile_tokens, starts[request + 1])
    # New tokens of a request are its last query_len positions.
    last_position = metadata.seq_lens_cpu.to(torch.int64)[request] - (starts[request + 1] - end_row) - 1
    order = torch.argsort(last_position, descending=True, stable=True)
    table = torch.stack([request, first_row, end_row])[:, order].to(torch.int32)
    return TokenTiles(upload(table, device), count)


def token_requests(metadata: AttentionMetadata) -> torch.Tensor:
    """``[T]`` int32 on the device: the request each new token belongs to."""
    starts = metadata.query_start_loc
    query_lens = (starts[1:] - starts[:-1]).to(torch.int64)
    requests = torch.arange(metadata.num_requests, device=starts.device, dtype=torch.int32)
    return torch.repeat_interleave(requests, query_lens, output_size=metadata.num_tokens)


@dataclass(frozen=True)
class GlobalBlocks:
    """Every request's logical blocks numbered consecutively across the batch (``count`` in all).

    ``first`` ``[R]`` int32: global id of each request's block 0.  Per global block (``[count]``):
    ``page`` (physical page, int64), ``first_position`` (position of its first key) and
    ``num_keys`` (keys it holds, ``block_size`` except in a request's last block).
    """

    first: torch.Tensor
    page: torch.Tensor
    first_position: torch.Tensor
    num_keys: torch.Tensor
    count: int


def global_blocks(metadata: AttentionMetadata) -> GlobalBlocks:
    block_size = metadata.block_size
    count = int(((metadata.seq_lens_cpu.to(torch.int64) + block_size - 1) // block_size).sum())
    seq_lens = metadata.seq_lens.to(torch.int64)
    blocks_per_request = (seq_lens + block_size - 1) // block_size
    first = torch.cumsum(blocks_per_request, 0) - blocks_per_request
    request = torch.repeat_interleave(
        torch.arange(metadata.num_requests, device=seq_lens.device), blocks_per_request, output_size=count
    )
    logical = torch.arange(count, device=seq_lens.device) - first[request]
    first_position = logical * block_size
    return GlobalBlocks(
        first=first.to(torch.int32),
        page=metadata.page_table[request, logical].to(torch.int64),
        first_position=first_position.to(torch.int32),
        num_keys=torch.clamp(seq_lens[request] - first_position, max=block_size).to(torch.int32),
        count=count,
    )
