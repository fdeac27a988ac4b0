"""Per-request page tables on top of the block pool: prefix lookup, slot allocation, publication, release.

The scheduler asks three things: how much of a waiting request's prefix is already cached
(``find_cached_prefix``), whether the next ``n`` tokens of a request fit (``allocate``), and, after
the step ran, to publish the request's newly completed blocks in the prefix cache
(``publish_computed_blocks``).  Publishing only after the forward wrote them means no request can
ever read a page whose content is still being computed, whatever the attention backend does.
"""

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from m3stack.engine.kv_cache.block_pool import BlockPool, KVBlock
from m3stack.engine.kv_cache.interfaces import KVRequest
from m3stack.engine.kv_cache.prefix_cache import extend_block_hashes

logger = logging.getLogger(__name__)


_NO_BLOCKS = np.zeros(0, dtype=np.int32)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # The same page tables as int32 arrays (capacity doubles as they grow), for the runner's page table.
        self._block_ids: dict[str, np.ndarray] = {}
        self._num_published: dict[str, int] = {}
        # Prompt tokens looked up in / found in the prefix cache at first admission (Prometheus counters).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # --- queries --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def can_admit(self, context_blocks: int, reserve: int) -> bool:
        """Whether a waiting request whose whole context needs ``context_blocks`` new blocks fits next to the
        ``reserve`` blocks the running requests may still grow into."""
        return context_blocks + reserve <= self.num_free_blocks

    @property
    def max_chunk_tokens(self) -> int:
        """The most new tokens one step may give a request: what the pool can place at once."""
        return self.capacity_tokens

    def block_ids(self, request_id: str) -> np.ndarray:
        """The request's page table as block ids (a view valid until its next allocation; do not modify)."""
        return self._block_ids.get(request_id, _NO_BLOCKS)[: self.num_held_blocks(request_id)]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    # --- second-tier hooks (engine.offload moves blocks of a page table to host memory) ----------

    def held_blocks(self, request_id: str) -> Sequence[KVBlock]:
        """The request's page table as blocks (read-only: change it with ``replace_block``)."""
        return self._blocks.get(request_id, ())

    def num_published_blocks(self, request_id: str) -> int:
        """Leading blocks of the request already entered into the prefix cache (never touched again by it)."""
        return self._num_published.get(request_id, 0)

    def replace_block(self, request_id: str, index: int, block: KVBlock) -> KVBlock:
        """Put ``block`` at ``index`` of the request's page table; the caller takes over the old block's reference."""
        held = self._blocks[request_id]
        old, held[index] = held[index], block
        self._block_ids[request_id][index] = block.block_id
        return old

    def find_cached_prefix(self, request: KVRequest) -> list[KVBlock]:
        """The longest run of cached blocks at the start of the request's tokens.

        At least one token is always left to compute: the step that computes it produces the
        logits of the next token.
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt token's hidden state, which a cached block has not
        extend_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_new_blocks(self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()) -> int:
        """Free-list slots that adding ``num_new_tokens`` (after a prefix hit of ``cached_prefix``) consumes."""
        held = self.num_held_blocks(request.request_id)
        total_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        fresh = max(0, blocks_for(total_tokens, self.block_size) - held - len(cached_prefix))
        # An idle cached block sits in the free list: taking a reference removes it from there too.
        idle_hits = sum(1 for block in cached_prefix if block.ref_count == 0)
        return fresh + idle_hits

    # --- changes --------------------------------------------------------------------------------

    def allocate(
        self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = (), reserve: int = 0
    ) -> bool:
        """Make room for the request's next ``num_new_tokens`` tokens, first taking ``cached_prefix``.

        Returns False and changes nothing when fewer than the needed blocks plus ``reserve`` are free.
        The caller advances ``request.num_computed_tokens`` past the prefix it accepted.
        """
        held = self._blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        if not cached_prefix and total_tokens <= len(held) * self.block_size:
            return True  # the common decode step: the last block still has room
        if self.num_new_blocks(request, num_new_tokens, cached_prefix) + reserve > self.pool.num_free_blocks:
            return False
        self._num_published.setdefault(request.request_id, 0)
        before = len(held)
        if cached_prefix:
            if held:
                raise RuntimeError(f"{request}: a cached prefix can only start an empty page table")
            self.pool.touch(cached_prefix)
            held.extend(cached_prefix)
            self._num_published[request.request_id] = len(cached_prefix)
        missing = blocks_for(total_tokens, self.block_size) - len(held)
        if missing > 0:
            held.extend(self.pool.allocate(missing))
        self._append_ids(request.request_id, held, before)
        return True

    def _append_ids(self, request_id: str, held: list[KVBlock], before: int) -> None:
        """Mirror ``held[before:]`` (just appended) into the request's id array, growing it when full."""
        ids = self._block_ids.get(request_id, _NO_BLOCKS)
        if len(ids) < len(held):
            grown = np.zeros(max(2 * len(ids), len(held), 8), dtype=np.int32)
            grown[:before] = ids[:before]
            ids = self._block_ids[request_id] = grown
        ids[before : len(held)] = [block.block_id for block in held[before:]]

    def publish_computed_blocks(self, request: KVRequest, num_computed: int) -> None:
        """Enter the request's full blocks among its first ``num_computed`` (written) tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        held = self._blocks.get(request.request_id)
        if not held:
            return
        num_full = min(num_computed, request.num_known_tokens) // self.block_size
        num_full = min(num_full, len(held))
        start = self._num_published[request.request_id]
        if num_full <= start:
            return
        extend_block_hashes(request, self.block_size)
        for index in range(start, num_full):
            self.pool.cache(held[index], request.block_hashes[index])
        self._num_published[request.request_id] = num_full

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget the idle blocks' cached content and the prefix counters (blocks in use keep theirs until freed)."""
        self.pool.reset_prefix_cache()
        self.prefix_query_tokens = self.prefix_hit_tokens = 0

    def free(self, request: KVRequest) -> None:
        """Release every block of the request, last first; cached ones stay findable until evicted."""
        self.pool.release(reversed(self.detach(request.request_id)))

    def detach(self, request_id: str) -> list[KVBlock]:
        """Forget the request's page table and return its blocks, their references still held: the caller releases
        them (a second tier gives its own blocks back to its own pool)."""
        self._block_ids.pop(request_id, None)
        self._num_published.pop(request_id, None)
        return self._blocks.pop(request_id, [])

    def live_references(self, lent: Iterable[KVBlock] = ()) -> dict[int, int]:
        """Block id -> number of live requests holding it, plus one per block of ``lent`` (blocks held outside the
        page tables, as a second tier's hot buffers), for invariant checks."""
        refs: dict[int, int] = {}
        for blocks in (*self._blocks.values(), lent):
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        return refs

    def check_invariants(self, lent: Iterable[KVBlock] = ()) -> None:
        """AssertionError when the pool's counts disagree with the page tables (and ``lent``, see ``live_references``)
        or a page table's id array with its blocks."""
        self.pool.check_invariants(self.live_references(lent))
        for request_id, held in self._blocks.items():
            ids = self.block_ids(request_id).tolist()
            assert ids == [b.block_id for b in held], f"{request_id}: page-table ids {ids} disagree with its blocks"
