"""A preallocated pool of KV pages with reference counts, an O(1) LRU free list and the prefix-cache index.

Every page of the device KV cache has one ``KVBlock`` created up front.  A block is either held by
one or more requests (``ref_count > 0``) or sits in the free list.  Free blocks keep their cached
content (and hash) until they are reused, so the free list doubles as the prefix cache's LRU
eviction order: allocation takes from the head, release appends at the tail.  Block 0 is a reserved
null page that is never handed out: padded slots (CUDA-graph batches) write there harmlessly.

A second tier (host offload) can observe evictions through ``on_evict`` and keep the content.
"""

from collections.abc import Callable, Iterable

NULL_BLOCK_ID = 0


class KVBlock:
    """One page: its id, how many requests hold it, and its prefix-cache hash when full and cached."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        # Links of the intrusive free list; both None when the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock({self.block_id}, ref={self.ref_count}, {cached})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop from the head, append, and removal anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks in the hot paths
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._length -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free list")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._length += 1

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns every ``KVBlock`` of the device cache: allocation, release, and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_count = 1  # never freed, never allocated
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.on_evict: Callable[[KVBlock, bytes], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, including cached blocks no request holds."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the LRU head, evicting their cached content."""
        if count > len(self.free_queue):
            raise ValueError(f"cannot allocate {count} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling idle ones out of the free list."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching zero go to the free-list tail in the given order.

        Callers pass a request's blocks last-first so its tail is evicted before the shared prefix.
        """
        for block in blocks:
            if block.ref_count <= 0 or block is self.null_block:
                raise RuntimeError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash.  An equal block already published wins (append-only tables
        tolerate the duplicate, which is simply never shared)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        block_hash = block.block_hash
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
        block.block_hash = None
        if self.on_evict is not None:
            self.on_evict(block, block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of idle blocks (blocks in use keep theirs until freed)."""
        for block in self.free_queue:
            self._evict(block)

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent.

        ``expected_refs`` (block id -> references held by live requests) additionally checks every
        reference count against the owners, so a leak or a double hold is caught.
        """
        in_free = [b.block_id for b in self.free_queue]
        assert len(in_free) == len(set(in_free)) == len(self.free_queue), "free list has duplicates or bad length"
        free_set = set(in_free)
        assert NULL_BLOCK_ID not in free_set and self.null_block.ref_count == 1, "null block was handed out"
        for block in self.blocks[1:]:
            assert block.ref_count >= 0, f"{block} has a negative count"
            assert (block.ref_count == 0) == (block.block_id in free_set), f"{block} free-list membership is wrong"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_count == want, f"{block} has ref {block.ref_count}, owners hold {want}"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} is indexed under a hash it does not carry"
