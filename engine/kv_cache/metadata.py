"""Per-step attention metadata: where each token of a flat varlen batch lives in the paged cache."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Built once per engine step by the runner and read by every layer.

    A step holds R requests and T new tokens.  Request r's new tokens are rows
    ``query_start_loc[r] : query_start_loc[r + 1]`` of every ``[T, ...]`` tensor and sit at
    positions ``seq_lens[r] - query_len(r) .. seq_lens[r] - 1``; earlier positions are already in
    the cache (a prefix hit or previous chunks).  Page ``page_table[r, i]`` holds positions
    ``i * block_size .. (i + 1) * block_size - 1`` of request r in every layer.
    """

    block_size: int
    # Device tensors.
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, context length after this step (cached + new)
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, page_id * block_size + offset of each new token
    page_table: torch.Tensor  # [R, max_pages] int32; entries past a request's pages are 0
    # Host copies, for planning kernels without a device sync.
    query_start_loc_cpu: torch.Tensor  # [R + 1] int32
    seq_lens_cpu: torch.Tensor  # [R] int32

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens_cpu.max()) if self.num_requests else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.num_requests else 0

    @property
    def is_pure_decode(self) -> bool:
        """Every request adds exactly one token (the CUDA-graph-able case)."""
        return self.num_requests > 0 and self.num_tokens == self.num_requests
