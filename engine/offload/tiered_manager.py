"""A KV manager with a host tier: blocks leave the device under pressure, shared prefixes stay.

It is the paged manager (``engine.kv_cache.manager``) and a host pool (``host_pool``) composed: the page tables
are the paged manager's, and a moved block's entry in one names a host slot.

When a request needs device blocks that are not free, ``allocate`` first spills blocks of running
requests to the host (``layout``), then allocates as usual.  A block may move when

* exactly one request holds it (a prefix shared by running requests stays on the device), and it did
  not come from a prefix hit (a prefix reused once is likely reused again);
* its tokens were computed by a step already launched: the copy is enqueued on the same device stream
  after that step (``DeviceOffload.before_step``), so it reads the final KV even while the step is in
  flight (async scheduling);
* it is not among the request's last ``keep_tail_blocks`` (MSA's local blocks and the block being
  filled stay, so the blocks a decode step cannot do without are always on the device).

The longest holders give first, oldest blocks first.  A request's first spill also leases it a hot
buffer of ``hot_blocks`` device pages (``HotLease``) through which its decode steps read host blocks;
a request whose spillable blocks would not pay for that lease is left alone.

Moving a block is bookkeeping here (the page-table entry becomes a ``HostBlock``, the device block is
released, keeping its prefix-cache hash: its content stays valid until reused); the data moves when
the runner hands the pending ``Migration`` list to ``DeviceOffload.before_step``, on the device
stream before the next forward, so a freed page is never overwritten before it was copied.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from m3stack.engine.kv_cache.block_pool import KVBlock
from m3stack.engine.kv_cache.interfaces import KVRequest
from m3stack.engine.kv_cache.manager import KVCacheManager
from m3stack.engine.offload.host_pool import HostBlock, HostBlockPool
from m3stack.engine.offload.layout import TierSizes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Migration:
    """Block content moving from device page ``device_id`` to host slot ``host_slot`` (id ``host_id``)."""

    device_id: int
    host_id: int
    host_slot: int


@dataclass
class HotLease:
    """Device pages lent to one request's hot buffer, and the row of the device-side hot state it uses."""

    handle: int
    pages: list[KVBlock]


@dataclass
class PendingWork:
    """What the device must do before the next forward: copies out, and hot buffers to (re)initialize."""

    migrations: list[Migration]
    new_leases: list[HotLease]


class TieredKVCacheManager:
    """A paged manager over the device pool (``paged``) and a host pool (``host``) its page tables may also name.

    The scheduler sees it as any ``KVManager``; the page tables, prefix lookups and publication are the paged
    manager's, and this class adds where blocks may go when the device runs short."""

    def __init__(
        self,
        sizes: TierSizes,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        hot_blocks: int,
        keep_tail_blocks: int,
        max_requests: int,
    ) -> None:
        self.paged = KVCacheManager(sizes.num_device, block_size, enable_prefix_caching)
        self.pool = self.paged.pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if hot_blocks < 1 or keep_tail_blocks < 1:
            raise ValueError(f"need hot_blocks >= 1 and keep_tail_blocks >= 1, got {hot_blocks}, {keep_tail_blocks}")
        if self.pool.num_usable_blocks - hot_blocks - keep_tail_blocks < 1:
            raise ValueError(
                f"{self.pool.num_usable_blocks} device blocks leave no room for a prefill chunk next to a request's "
                f"hot buffer ({hot_blocks}) and kept tail ({keep_tail_blocks}): give the device more KV blocks"
            )
        self.host = HostBlockPool(sizes.num_device, sizes.num_host)
        self.hot_blocks = hot_blocks
        self.keep_tail_blocks = keep_tail_blocks
        self._free_handles = list(range(max_requests - 1, -1, -1))
        self._leases: dict[str, HotLease] = {}
        self._prefix_hits: dict[str, int] = {}  # leading blocks that came from a prefix hit
        self._pending = PendingWork([], [])
        self._holders: dict[str, KVRequest] = {}  # requests that allocated blocks and were not freed since
        self.num_spilled_blocks = 0

    # --- capacity as the scheduler sees it --------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can still grow into: free device blocks, and host slots spilling can use."""
        return self.pool.num_free_blocks + self.host.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_usable_blocks + self.host.num_blocks) * self.block_size

    def can_admit(self, context_blocks: int, reserve: int) -> bool:
        """Host slots count only for blocks that can get there.  A request too short to pay for a hot buffer
        never spills: its blocks need the device's free blocks plus what spilling the running requests can
        free (computed only when the free blocks alone do not do), else it would be admitted only to be
        preempted when the device runs out."""
        needed = context_blocks + reserve
        if needed <= self.pool.num_free_blocks:
            return True
        if context_blocks - self.keep_tail_blocks > self.hot_blocks:
            return needed <= self.num_free_blocks
        return needed <= self.pool.num_free_blocks + min(self._movable_blocks(), self.host.num_free_blocks)

    def _movable_blocks(self) -> int:
        """Device blocks spilling could free now, net of the hot buffers it would have to lease."""
        movable = 0
        for request_id in self._holders:
            lease_cost = 0 if request_id in self._leases else self.hot_blocks
            movable += max(0, len(self._spillable(request_id)) - lease_cost)
        return movable

    @property
    def max_chunk_tokens(self) -> int:
        """A chunk's new blocks must sit on the device during its step, next to the request's own kept tail and
        hot buffer; every other block can move to the host.  A larger chunk could never be placed."""
        return (self.pool.num_usable_blocks - self.hot_blocks - self.keep_tail_blocks) * self.block_size

    @property
    def host_usage(self) -> float:
        return self.host.usage

    @property
    def num_hot_buffers(self) -> int:
        return len(self._leases)

    def handle(self, request_id: str) -> int:
        """Row of the request's hot buffer in the device state, or -1 when it has no host block."""
        lease = self._leases.get(request_id)
        return -1 if lease is None else lease.handle

    def take_pending(self) -> PendingWork:
        pending, self._pending = self._pending, PendingWork([], [])
        return pending

    # --- the paged manager's page tables and prefix cache -----------------------------------------

    @property
    def prefix_query_tokens(self) -> int:
        return self.paged.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.paged.prefix_hit_tokens

    def block_ids(self, request_id: str) -> np.ndarray:
        return self.paged.block_ids(request_id)

    def num_held_blocks(self, request_id: str) -> int:
        return self.paged.num_held_blocks(request_id)

    def held_blocks(self, request_id: str) -> Sequence[KVBlock]:
        return self.paged.held_blocks(request_id)

    def find_cached_prefix(self, request: KVRequest) -> list[KVBlock]:
        return self.paged.find_cached_prefix(request)

    def num_new_blocks(self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()) -> int:
        return self.paged.num_new_blocks(request, num_new_tokens, cached_prefix)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.paged.record_prefix_lookup(num_prompt_tokens, num_hit_tokens)

    def reset_prefix_cache(self) -> None:
        self.paged.reset_prefix_cache()

    # --- changes --------------------------------------------------------------------------------

    def allocate(
        self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = (), reserve: int = 0
    ) -> bool:
        if cached_prefix:
            self._prefix_hits[request.request_id] = len(cached_prefix)
        short = self.num_new_blocks(request, num_new_tokens, cached_prefix) + reserve - self.pool.num_free_blocks
        if short > 0:
            # Hold the prefix hit while spilling: a hot-buffer lease must not take (evict) one of its idle blocks.
            self.pool.touch(cached_prefix)
            self._spill(short)
            self.pool.release(reversed(cached_prefix))
        allocated = self.paged.allocate(request, num_new_tokens, cached_prefix, reserve)
        if allocated:
            self._holders[request.request_id] = request
        return allocated

    def publish_computed_blocks(self, request: KVRequest, num_computed: int) -> None:
        """Publish as usual, but never past a block that moved to the host before it was published: host blocks
        belong to one request and stay out of the prefix cache (so are the device blocks after it)."""
        held = self.held_blocks(request.request_id)
        for index in range(self.paged.num_published_blocks(request.request_id), len(held)):
            if isinstance(held[index], HostBlock):
                num_computed = min(num_computed, index * self.block_size)
                break
        self.paged.publish_computed_blocks(request, num_computed)

    def free(self, request: KVRequest) -> None:
        """Give back the request's hot buffer, its host slots (dropping copies into them not yet run) and its device
        blocks, last first."""
        request_id = request.request_id
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self.pool.release(lease.pages)
            self._free_handles.append(lease.handle)
        self._prefix_hits.pop(request_id, None)
        self._holders.pop(request_id, None)
        held = self.paged.detach(request_id)
        released_slots = set()
        for block in held:
            if isinstance(block, HostBlock):
                self.host.release(block)
                released_slots.add(block.host_slot)
        if released_slots:  # a copy into a slot given back before it ran must not race a later owner's copy
            pending = self._pending.migrations
            self._pending.migrations = [m for m in pending if m.host_slot not in released_slots]
        self.pool.release(reversed([block for block in held if not isinstance(block, HostBlock)]))

    # --- spilling -------------------------------------------------------------------------------

    def _spillable(self, request_id: str) -> list[int]:
        """Indices of the request's blocks that may move to the host now (see the module docstring)."""
        held = self.held_blocks(request_id)
        computed = self._holders[request_id].num_computed_tokens // self.block_size
        end = min(computed, len(held) - self.keep_tail_blocks)
        start = self._prefix_hits.get(request_id, 0)
        return [i for i in range(start, end) if not isinstance(held[i], HostBlock) and held[i].ref_count == 1]

    def _spill(self, short: int) -> None:
        """Move blocks to the host until ``short`` more device blocks are free (or nothing more can move)."""
        candidates = []
        for request_id in list(self._holders):
            indices = self._spillable(request_id)
            lease_cost = 0 if request_id in self._leases else self.hot_blocks
            if len(indices) > lease_cost:
                candidates.append((len(indices) - lease_cost, request_id, indices, lease_cost))
        candidates.sort(key=lambda c: -c[0])
        freed = 0
        for _, request_id, indices, lease_cost in candidates:
            if freed >= short:
                break
            count = min(len(indices), short - freed + lease_cost, self.host.num_free_blocks)
            if count <= lease_cost or (lease_cost and not self._free_handles):
                continue
            for index in indices[:count]:
                self._spill_block(request_id, index)
            if lease_cost:
                pages = self.pool.allocate(self.hot_blocks)
                lease = HotLease(self._free_handles.pop(), pages)
                self._leases[request_id] = lease
                self._pending.new_leases.append(lease)
            freed += count - lease_cost
        if freed:
            logger.debug("spilled to the host: %d device blocks freed, %d free", freed, self.pool.num_free_blocks)

    def _spill_block(self, request_id: str, index: int) -> None:
        host_block = self.host.allocate()
        device_block = self.paged.replace_block(request_id, index, host_block)
        self._pending.migrations.append(Migration(device_block.block_id, host_block.block_id, host_block.host_slot))
        self.pool.release([device_block])
        self.num_spilled_blocks += 1

    # --- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.paged.check_invariants(lent=[page for lease in self._leases.values() for page in lease.pages])
        held_host = [b for rid in self._holders for b in self.held_blocks(rid) if isinstance(b, HostBlock)]
        self.host.check_invariants(held_host)
        for request_id in self._holders:
            has_host = any(isinstance(b, HostBlock) for b in self.held_blocks(request_id))
            assert not has_host or request_id in self._leases, f"{request_id} has host blocks but no hot buffer"
        handles = [lease.handle for lease in self._leases.values()]
        assert len(handles) == len(set(handles)) and not set(handles) & set(self._free_handles), "hot handles reused"
