"""``DeviceOffload``: the device side of CPU KV offload, called by the runner and the attention backends.

Per step (``before_step``, from the runner, before the forward is launched; the manager's decisions for it are an
``OffloadStep``, which a parallel engine's rank 0 also sends to its workers, whose ``DeviceOffload`` applies it to
their own heads' tiers):

1. the spills the tiered manager decided run first, on the compute stream: MSA K/V of every layer to
   pinned host memory (``page_copy``), index keys and dense-layer K/V to the block's host id on the
   device.  Everything later in the stream (this step's writes into the freed pages) sees them done;
2. new hot buffers are initialized, the clock advances, the miss queues empty;
3. each request of the step gets its hot-buffer handle in a fixed device buffer (-1: no host block),
   which CUDA graphs captured once read on every replay.

Per MSA layer, in the GPU backend: decode steps call ``resolve_decode`` between the indexer and the
attention (``resolver`` rewrites the selected host blocks to hot pages on the device, then the misses
are copied on a side stream that the attention waits for); prefill steps call ``sparse_prefill``,
which runs the usual kernels on a working set for each request with host blocks
(``prefill_staging``).  The reference backend calls ``reference_kv`` instead: the same rules in plain
PyTorch, one request at a time.

A decode step of a request with host blocks must add one token (``needs_prefill_path`` sends other
steps to the prefill path): that bounds its distinct host blocks per layer by the hot buffer's size.
"""

import time
from dataclasses import dataclass

import numpy as np
import torch

from m3stack.engine.host_copy import staged, upload
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.msa.decode_plan import SparseDecodePlan
from m3stack.engine.msa.prefill_attention import sparse_prefill as msa_sparse_prefill
from m3stack.engine.offload.hot_buffer import STAT_CHURNED, STAT_HITS, STAT_MISSES, STAT_SELECTED, HotStateTensors
from m3stack.engine.offload.layout import TieredKVCache
from m3stack.engine.offload.metrics import OffloadStats
from m3stack.engine.offload.page_copy import copy_pages, plan_page_copy
from m3stack.engine.offload.prefill_staging import gather_working_set, request_metadata
from m3stack.engine.offload.resolver import churn, entries_per_request, resolve_decode_pages, resolve_request
from m3stack.engine.offload.tiered_manager import TieredKVCacheManager

# Device counters are copied back at most this often (the server asks for statistics after every step).
_STATS_PERIOD_S = 0.25


@dataclass(frozen=True)
class OffloadStep:
    """What the device side does before one forward, as the tiered manager decided it (plain integers)."""

    migrations: np.ndarray  # [N, 3] int64: device id, host id, host slot of each block to spill
    leases: list[tuple[int, np.ndarray]]  # (handle, page ids) of each hot buffer to (re)start, in lease order
    handles: np.ndarray  # [R] int32: each request's hot-buffer handle, -1 without host blocks
    query_lens: np.ndarray  # [R] int64: tokens each request adds

    def to_ints(self) -> np.ndarray:
        """``[N, L, R, migrations (3N), (handle, count, pages) per lease, handles, query lens]``."""
        leases = [np.concatenate([[handle, len(pages)], pages]) for handle, pages in self.leases]
        parts = [[len(self.migrations), len(self.leases), len(self.handles)], self.migrations.reshape(-1), *leases,
                 self.handles, self.query_lens]  # fmt: skip
        return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])

    @classmethod
    def from_ints(cls, ints: np.ndarray) -> "OffloadStep":
        num_migrations, num_leases, num_requests = (int(v) for v in ints[:3])
        at = 3 + 3 * num_migrations
        migrations = ints[3:at].reshape(num_migrations, 3)
        leases = []
        for _ in range(num_leases):
            handle, count = int(ints[at]), int(ints[at + 1])
            leases.append((handle, ints[at + 2 : at + 2 + count]))
            at += 2 + count
        handles = ints[at : at + num_requests].astype(np.int32)
        query_lens = ints[at + num_requests : at + 2 * num_requests]
        if at + 2 * num_requests != len(ints):
            raise ValueError(f"an offload step of {len(ints)} integers does not parse")
        return cls(migrations, leases, handles, query_lens)


@dataclass
class _Timed:
    """A copy bracketed by CUDA events, waiting to be read once the GPU has passed it."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    decode: bool  # a decode miss copy (its bytes are counted on the device) or a prefill staging copy
    staged_bytes: int


class DeviceOffload:
    def __init__(
        self,
        cache: TieredKVCache,
        manager: TieredKVCacheManager,
        *,
        num_kv_heads: int,
        topk: int,
        max_batch: int,
        max_requests: int,
        device: torch.device,
    ) -> None:
        self.cache = cache
        self.manager = manager
        self.device = device
        # Copies run as Triton kernels on a GPU; on CPU (tests) as indexed assignment, interpreted or not.
        self.torch_copies = device.type != "cuda"
        self.num_device = cache.sizes.num_device
        self.num_kv_heads = num_kv_heads
        self.topk = topk
        self.page_bytes = cache.host_sparse[0, :, 0].numel() * cache.host_sparse.element_size()  # K + V, one layer
        self.state = HotStateTensors.allocate(
            max_requests=max_requests, num_msa_layers=len(cache.sparse_layer_ids), hot_blocks=manager.hot_blocks,
            entries=entries_per_request(num_kv_heads, topk), max_batch=max_batch, device=device,
        )  # fmt: skip
        self.handles = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Each MSA layer's miss copy (host pages -> its device pages), planned once (CUDA only).
        msa_layers = range(len(cache.sparse_layer_ids)) if device.type == "cuda" else range(0)
        self._miss_copies = [plan_page_copy(cache.host_sparse[msa], cache.device_sparse[msa]) for msa in msa_layers]
        # Host copies of this step's per-request handles and token counts (set by before_step).
        self._step_handles = np.zeros(0, dtype=np.int32)
        self._step_query_lens = np.zeros(0, dtype=np.int64)
        self._handles_dirty = False
        self.last_step: OffloadStep | None = None  # the manager's decisions for the step being launched
        # Cumulative counters kept on the host.
        self.spill_bytes = 0
        self.staged_bytes = 0
        self.timing = False  # CUDA-event timing of copies (benchmarks); eager steps only
        self._timed: list[_Timed] = []
        self._timed_pages = torch.zeros(1, dtype=torch.int64, device=device)  # miss pages of timed copies
        self._miss_copy_s = 0.0
        self._staging_s = 0.0
        self._timed_staged_bytes = 0
        self._device_stats = torch.zeros((self.state.stats.numel() + 1,), dtype=torch.int64)
        self._stats_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._stats_copied_at = 0.0

    # --- per step -------------------------------------------------------------------------------

    def before_step(self, request_ids: list[str], query_lens: np.ndarray) -> None:
        """Apply the manager's decisions for this step (``last_step`` keeps them for a parallel engine's workers)."""
        pending = self.manager.take_pending()
        migrations = np.array([(m.device_id, m.host_id, m.host_slot) for m in pending.migrations], dtype=np.int64)
        self.last_step = OffloadStep(
            migrations=migrations.reshape(-1, 3),
            leases=[(lease.handle, np.array([p.block_id for p in lease.pages], dtype=np.int64))
                    for lease in pending.new_leases],
            handles=np.fromiter((self.manager.handle(r) for r in request_ids), dtype=np.int32, count=len(request_ids)),
            query_lens=np.asarray(query_lens, dtype=np.int64),
        )  # fmt: skip
        self.apply(self.last_step)

    def apply(self, step: OffloadStep) -> None:
        """Run the step's spills, start its new hot buffers, and publish its handles (rows in step order)."""
        if len(step.migrations):
            self._migrate(step.migrations)
        if step.leases:
            self.state.start_leases(step.leases)
        self.state.begin_step()
        handles = step.handles
        self._step_handles, self._step_query_lens = handles, step.query_lens
        if handles.size and (handles >= 0).any():
            self.handles.fill_(-1)
            self.handles[: handles.size].copy_(staged(handles, self.device), non_blocking=True)
            self._handles_dirty = True
        elif self._handles_dirty:
            self.handles.fill_(-1)
            self._handles_dirty = False

    @property
    def step_has_host_blocks(self) -> bool:
        return bool((self._step_handles >= 0).any())

    def needs_prefill_path(self) -> bool:
        """A request with host blocks adds several tokens: its MSA layers must take the prefill path."""
        return bool(((self._step_handles >= 0) & (self._step_query_lens > 1)).any())

    def _migrate(self, migrations: np.ndarray) -> None:
        cache = self.cache
        # One upload, transposed on the device: [3, N] rows of device ids, host ids, host slots.
        device_ids, host_ids, slots = upload(torch.from_numpy(migrations), self.device).T
        copy_pages(
            cache.device_sparse.flatten(0, 1), cache.host_sparse.flatten(0, 1),
            device_ids.to(torch.int32), slots.to(torch.int32), torch_only=self.torch_copies,
        )  # fmt: skip
        cache.index_keys[:, host_ids] = cache.index_keys[:, device_ids]
        if cache.dense_kv is not None:
            cache.dense_kv[:, :, host_ids] = cache.dense_kv[:, :, device_ids]
        self.spill_bytes += len(migrations) * len(cache.sparse_layer_ids) * self.page_bytes

    # --- decode (GPU backend) -------------------------------------------------------------------

    def resolve_decode(self, layer: int, plan: SparseDecodePlan, metadata: AttentionMetadata) -> None:
        """Point the decode plan's host blocks at hot pages and copy the misses in (side stream)."""
        # On a GPU the kernels always run (they return at once for requests without host blocks), so CUDA
        # graphs capture them and the warm-up before capture compiles them.
        if self.device.type != "cuda" and not self.step_has_host_blocks:
            return
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        msa = self.cache.msa_slot(layer)
        resolve_decode_pages(plan.page_ids, plan.row_indptr, metadata.query_start_loc,
                             self.handles[: metadata.num_requests], self.state, msa, self.num_device,
                             self.num_kv_heads, self.topk)  # fmt: skip
        self._copy_misses(msa, timed=self.timing and not capturing)

    def _copy_misses(self, msa: int, timed: bool) -> None:
        state = self.state
        indices = (state.miss_src[msa], state.miss_dst[msa], state.miss_count[msa : msa + 1])
        if self.copy_stream is None:
            copy_pages(self.cache.host_sparse[msa], self.cache.device_sparse[msa], *indices,
                       torch_only=self.torch_copies)  # fmt: skip
            return
        plan = self._miss_copies[msa]
        main = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(main)
        with torch.cuda.stream(self.copy_stream):
            # Only the launch between the events: when eager steps leave the GPU idle, the copy stream reaches the
            # start event as soon as it is recorded, and any host work before the launch would count as copy time.
            events = self._start_timing() if timed else None
            plan.run(*indices)
            if events is not None:
                self._finish_timing(events, decode=True, staged_bytes=0)
                self._timed_pages += state.miss_count[msa]
        main.wait_stream(self.copy_stream)

    # --- prefill (GPU backend) ------------------------------------------------------------------

    def sparse_prefill(
        self, layer: int, q: torch.Tensor, selection: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """``msa.prefill_attention.sparse_prefill`` for a step whose requests may have host blocks."""
        cache = self.cache.layers[layer]
        offloaded = np.flatnonzero(self._step_handles >= 0)
        if not offloaded.size:
            return msa_sparse_prefill(q, cache.key, cache.value, selection, metadata, scale)
        starts = metadata.query_start_loc_cpu.tolist()
        masked = selection.clone()
        for request in offloaded:  # their rows are computed on working sets below
            masked[:, starts[request] : starts[request + 1]] = -1
        out = msa_sparse_prefill(q, cache.key, cache.value, masked, metadata, scale)
        msa = self.cache.msa_slot(layer)
        for request in offloaded:
            rows = slice(starts[request], starts[request + 1])
            working = self._working_set(msa, selection[:, rows], metadata.page_table[request])
            sub = request_metadata(metadata, int(request), working.page_table)
            out[rows] = msa_sparse_prefill(q[rows], working.key, working.value, selection[:, rows], sub, scale)
        return out

    def _working_set(self, msa: int, selection: torch.Tensor, page_row: torch.Tensor):
        events = self._start_timing() if self.timing and self.device.type == "cuda" else None
        working = gather_working_set(selection, page_row, self.num_device, self.cache.device_sparse[msa],
                                     self.cache.host_sparse[msa], torch_only=self.torch_copies)  # fmt: skip
        staged = working.host_pages * self.page_bytes
        self.staged_bytes += staged
        if events is not None:
            self._finish_timing(events, decode=False, staged_bytes=staged)
        return working

    # --- the reference backend ------------------------------------------------------------------

    def has_host_blocks(self, row: int) -> bool:
        return row < self._step_handles.size and self._step_handles[row] >= 0

    def reference_kv(
        self, layer: int, row: int, pages: torch.Tensor, seq_len: int, selected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[seq_len, Hkv, D]`` of request ``row`` for the blocks ``selected`` (``[Hkv, T, K]``)
        names; other host blocks read as zeros.  One token: through the hot buffer; more: straight from host."""
        msa = self.cache.msa_slot(layer)
        device_kv = self.cache.device_sparse[msa]  # [2, num_device, Hkv, B, D]
        on_device = pages < self.num_device
        gathered = torch.zeros((2, pages.numel(), *device_kv.shape[2:]), dtype=device_kv.dtype, device=pages.device)
        gathered[:, on_device] = device_kv[:, pages[on_device]]
        if selected.shape[1] == 1:
            self._reference_decode(msa, row, pages, selected, gathered)
        else:
            blocks = torch.unique(selected[selected >= 0])
            blocks = blocks[pages[blocks] >= self.num_device]
            gathered[:, blocks] = self.cache.host_sparse[msa][:, pages[blocks] - self.num_device].to(pages.device)
            self.staged_bytes += blocks.numel() * self.page_bytes
        keys, values = (part.transpose(1, 2).flatten(0, 1)[:seq_len] for part in gathered)
        return keys, values

    def _reference_decode(self, msa: int, row: int, pages: torch.Tensor, selected: torch.Tensor,
                          gathered: torch.Tensor) -> None:  # fmt: skip
        state, handle = self.state, int(self._step_handles[row])
        flat = selected[:, 0].flatten()  # (head, rank) order, as the kernel reads its rows
        entries = torch.where(flat >= 0, pages[flat.clamp(min=0)], -1).tolist()
        slot_block, slot_stamp = state.slot_block[handle, msa].tolist(), state.slot_stamp[handle, msa].tolist()
        resolution = resolve_request(entries, slot_block, slot_stamp, int(state.clock), self.num_device)
        state.slot_block[handle, msa] = torch.tensor(slot_block, dtype=torch.int32)
        state.slot_stamp[handle, msa] = torch.tensor(slot_stamp, dtype=torch.int32)
        hot_pages = state.slot_page[handle]
        if resolution.copies:
            sources = torch.tensor([page - self.num_device for _, page in resolution.copies], dtype=torch.int32)
            targets = hot_pages[[slot for slot, _ in resolution.copies]]
            copy_pages(self.cache.host_sparse[msa], self.cache.device_sparse[msa], sources, targets, torch_only=True)
        device_kv = self.cache.device_sparse[msa]
        for block, slot in zip(flat.tolist(), resolution.slots, strict=True):
            if slot >= 0:
                gathered[:, block] = device_kv[:, int(hot_pages[slot])]
        previous = state.previous[handle, msa]
        selected_count, churned = churn(entries, previous.tolist())
        distinct = list(dict.fromkeys(p for p in entries if p >= 0))
        previous.fill_(-1)
        previous[: len(distinct)] = torch.tensor(distinct, dtype=torch.int32)
        stats = state.stats[msa]
        stats[STAT_HITS] += resolution.hits
        stats[STAT_MISSES] += len(resolution.copies)
        stats[STAT_SELECTED] += selected_count
        stats[STAT_CHURNED] += churned

    # --- timing and statistics ------------------------------------------------------------------

    def _start_timing(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _finish_timing(self, events: tuple[torch.cuda.Event, torch.cuda.Event], decode: bool,
                       staged_bytes: int) -> None:  # fmt: skip
        events[1].record()
        self._timed.append(_Timed(events[0], events[1], decode, staged_bytes))

    def _collect_timings(self) -> None:
        done = [timed for timed in self._timed if timed.end.query()]
        self._timed = [timed for timed in self._timed if timed not in done]
        for timed in done:
            seconds = timed.start.elapsed_time(timed.end) / 1e3
            if timed.decode:
                self._miss_copy_s += seconds
            else:
                self._staging_s += seconds
                self._timed_staged_bytes += timed.staged_bytes

    def _read_device_stats(self) -> np.ndarray:
        """The resolver's counters and the timed miss pages, as of the last copy the GPU finished."""
        if self.device.type != "cuda":
            return torch.cat([self.state.stats.flatten(), self._timed_pages]).numpy()
        if self._stats_copy is not None and self._stats_copy[1].query():
            self._device_stats = self._stats_copy[0].clone()
            self._stats_copy = None
        if self._stats_copy is None and time.monotonic() - self._stats_copied_at >= _STATS_PERIOD_S:
            self._stats_copied_at = time.monotonic()
            flat = torch.cat([self.state.stats.flatten(), self._timed_pages])
            target = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            target.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._stats_copy = (target, event)
        return self._device_stats.numpy()

    def reset_counters(self) -> None:
        """Start the cumulative counters again from zero (after the warm-up: its steps are no user's, and its first
        timed copies bracket kernel compiles).  Gauges of the current state (host blocks used, hot buffers) stay."""
        self.manager.num_spilled_blocks = 0
        self.spill_bytes = 0
        self.staged_bytes = 0
        # Timings not yet read and a counter readback in flight hold the warm-up's values: dropped, never read.
        self._timed.clear()
        self._stats_copy = None
        self._stats_copied_at = 0.0
        self._miss_copy_s = 0.0
        self._staging_s = 0.0
        self._timed_staged_bytes = 0
        # On the compute stream, after the warm-up's resolver and copy kernels (the copy stream joins it after each).
        self.state.stats.zero_()
        self._timed_pages.zero_()
        self._device_stats.zero_()

    def stats(self) -> OffloadStats:
        if self.device.type == "cuda":
            self._collect_timings()
        values = self._read_device_stats()
        per_layer = values[:-1].reshape(self.state.stats.shape).sum(axis=0)
        host = self.manager.host
        return OffloadStats(
            host_blocks=host.num_blocks,
            host_blocks_used=host.num_blocks - host.num_free_blocks,
            hot_buffers=self.manager.num_hot_buffers,
            spilled_blocks=self.manager.num_spilled_blocks,
            spill_bytes=self.spill_bytes,
            hot_hits=int(per_layer[STAT_HITS]),
            hot_misses=int(per_layer[STAT_MISSES]),
            miss_bytes=int(per_layer[STAT_MISSES]) * self.page_bytes,
            staged_bytes=self.staged_bytes,
            selected_blocks=int(per_layer[STAT_SELECTED]),
            churned_blocks=int(per_layer[STAT_CHURNED]),
            miss_copy_seconds=self._miss_copy_s,
            timed_miss_bytes=int(values[-1]) * self.page_bytes,
            staging_seconds=self._staging_s,
            timed_staged_bytes=self._timed_staged_bytes,
        )
