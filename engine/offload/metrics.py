"""What offload did, cumulative since the engine started: the numbers ``/metrics`` and the benchmarks report.

Counts of blocks come from two places: the tiered manager and the step's host-side work (spills,
prefill staging) count on the host; the decode resolver counts hits, misses and churn on the device
(``hot_buffer.STAT_*``), read back without waiting for the GPU (a pinned copy per step, read one step
later).  Copy times are CUDA-event intervals around the copies, measured only when timing is on
(``DeviceOffload.timing``) and only for steps run eagerly: events inside a replayed CUDA graph
cannot be timed.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadStats:
    host_blocks: int  # the pinned pool's size in blocks
    host_blocks_used: int
    hot_buffers: int  # requests holding a hot buffer now
    spilled_blocks: int  # blocks moved device -> host
    spill_bytes: int  # device -> host bytes of those moves
    hot_hits: int  # distinct host blocks a decode step found in its hot buffer (per MSA layer)
    hot_misses: int  # ... and had to copy in
    miss_bytes: int  # host -> device bytes of those copies
    staged_bytes: int  # host -> device bytes prefill chunks read from host blocks
    selected_blocks: int  # distinct blocks selected by decode steps of requests with host blocks (per layer)
    churned_blocks: int  # of those, blocks the request's previous step did not select
    miss_copy_seconds: float  # device time of the timed miss copies (the decode's stall on them)
    timed_miss_bytes: int  # bytes those timed copies moved
    staging_seconds: float  # device time of the timed prefill staging copies
    timed_staged_bytes: int

    @property
    def hit_rate(self) -> float:
        lookups = self.hot_hits + self.hot_misses
        return self.hot_hits / lookups if lookups else 0.0

    @property
    def churn_rate(self) -> float:
        return self.churned_blocks / self.selected_blocks if self.selected_blocks else 0.0

    @property
    def miss_gbps(self) -> float:
        """Host -> device rate of the decode misses, GB/s (1e9 bytes), over the timed copies."""
        return self.timed_miss_bytes / self.miss_copy_seconds / 1e9 if self.miss_copy_seconds else 0.0

    @property
    def staging_gbps(self) -> float:
        return self.timed_staged_bytes / self.staging_seconds / 1e9 if self.staging_seconds else 0.0
