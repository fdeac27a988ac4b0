"""The device-side state of every hot buffer, one row per lease handle (``tiered_manager.HotLease``).

A hot buffer is ``H`` device pages lent to one request; in each MSA layer every page independently holds
one of the request's host blocks (the page is a full block in every layer's tensor).  The state says
which block each (handle, layer, slot) holds and when a step last used it; ``resolver`` reads and
updates it on the device.  A new lease starts empty: no block, stamp 0 (older than any step), no
previous selection.
"""

from dataclasses import dataclass

import numpy as np
import torch

from m3stack.engine.host_copy import upload

# Columns of the per-layer statistics (int64 [L_msa, NUM_STATS]), counted by the resolver.
STAT_HITS = 0  # distinct host blocks found in the hot buffer
STAT_MISSES = 1  # distinct host blocks copied host -> device
STAT_SELECTED = 2  # distinct blocks selected (all tiers), counted on steps that follow a selection
STAT_CHURNED = 3  # of those, blocks the previous step did not select
NUM_STATS = 4


@dataclass
class HotStateTensors:
    slot_block: torch.Tensor  # [M, L_msa, H] int32, host block id held, -1 when empty
    slot_stamp: torch.Tensor  # [M, L_msa, H] int32, clock of the step that last used the slot
    slot_page: torch.Tensor  # [M, H] int32, the device page of each slot
    previous: torch.Tensor  # [M, L_msa, E] int32, last step's distinct selection (-1 padded), for churn
    clock: torch.Tensor  # [1] int32, advanced once per step
    miss_src: torch.Tensor  # [L_msa, max_batch * H] int32, host slots to copy in this step, per layer
    miss_dst: torch.Tensor  # [L_msa, max_batch * H] int32, the hot pages they go to
    miss_count: torch.Tensor  # [L_msa] int32, queue lengths (reset every step)
    stats: torch.Tensor  # [L_msa, NUM_STATS] int64, cumulative (STAT_* columns)

    @classmethod
    def allocate(
        cls, *, max_requests: int, num_msa_layers: int, hot_blocks: int, entries: int, max_batch: int,
        device: torch.device,
    ) -> "HotStateTensors":  # fmt: skip
        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        queue = max_batch * hot_blocks
        return cls(
            slot_block=full((max_requests, num_msa_layers, hot_blocks), -1),
            slot_stamp=full((max_requests, num_msa_layers, hot_blocks), 0),
            slot_page=full((max_requests, hot_blocks), 0),
            previous=full((max_requests, num_msa_layers, entries), -1),
            clock=full((1,), 0),
            miss_src=full((num_msa_layers, queue), 0),
            miss_dst=full((num_msa_layers, queue), 0),
            miss_count=full((num_msa_layers,), 0),
            stats=full((num_msa_layers, NUM_STATS), 0, torch.int64),
        )

    @property
    def hot_blocks(self) -> int:
        return int(self.slot_page.shape[1])

    def start_leases(self, leases: list[tuple[int, np.ndarray]]) -> None:
        """Empty the rows of newly leased handles (``(handle, page ids)``) and point them at their pages (in lease
        order: a handle leased twice since the last step ends with its last lease)."""
        for handle, page_ids in leases:
            # From pinned memory: a copy from pageable memory would wait for the step in flight.
            self.slot_page[handle] = upload(np.asarray(page_ids, dtype=np.int32), self.slot_page.device)
            self.slot_block[handle] = -1
            self.slot_stamp[handle] = 0
            self.previous[handle] = -1

    def begin_step(self) -> None:
        self.clock += 1
        self.miss_count.zero_()
