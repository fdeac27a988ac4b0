"""The host tier's block ids: which pinned host slots are taken.

A host block stands in a request's page table where a device block was before it moved out
(``tiered_manager``).  It belongs to that one request (shared prefixes never move), so it has no
prefix-cache hash and is freed with the request.  The pinned memory itself is ``layout.host_sparse``.
"""

from m3stack.engine.kv_cache.block_pool import KVBlock


class HostBlock(KVBlock):
    """A block whose MSA-layer K/V live in host slot ``block_id - first_id`` of the pinned pool."""

    __slots__ = ("host_slot",)

    def __init__(self, block_id: int, host_slot: int) -> None:
        super().__init__(block_id)
        self.host_slot = host_slot
        self.ref_count = 1

    def __repr__(self) -> str:
        return f"HostBlock({self.block_id}, slot {self.host_slot})"


class HostBlockPool:
    """Host slots ``0 .. num_blocks - 1`` named by block ids ``first_id + slot``; lowest free slot first."""

    def __init__(self, first_id: int, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host pool needs at least one block, got {num_blocks}")
        self.first_id = first_id
        self.num_blocks = num_blocks
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest
        self._in_use: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_host_id(self, block_id: int) -> bool:
        return block_id >= self.first_id

    def allocate(self) -> HostBlock:
        if not self._free_slots:
            raise ValueError("the host KV pool is full")
        slot = self._free_slots.pop()
        self._in_use.add(slot)
        return HostBlock(self.first_id + slot, slot)

    def release(self, block: HostBlock) -> None:
        if block.host_slot not in self._in_use:
            raise RuntimeError(f"double free of {block}")
        self._in_use.remove(block.host_slot)
        self._free_slots.append(block.host_slot)
        block.ref_count = 0

    def check_invariants(self, held: list[HostBlock]) -> None:
        """AssertionError unless ``held`` (every host block in a page table) is exactly the slots in use."""
        slots = [block.host_slot for block in held]
        assert len(slots) == len(set(slots)), "a host slot is held twice"
        assert set(slots) == self._in_use, "host slots in use disagree with the page tables"
        assert not self._in_use & set(self._free_slots), "a host slot is both free and in use"
        assert len(self._in_use) + len(self._free_slots) == self.num_blocks, "host slots were lost"
        for block in held:
            assert block.block_id == self.first_id + block.host_slot, f"{block} has the wrong id"
