"""The tiered KV manager's bookkeeping: which blocks move to the host, when, and what comes back on free."""

import pytest

from m3stack.engine.offload.host_pool import HostBlock
from m3stack.engine.offload.layout import TierSizes
from m3stack.engine.offload.tiered_manager import TieredKVCacheManager
from m3stack.engine.runtime.request import Request, SamplingParams

BLOCK = 4
DEVICE = 13  # 12 usable device blocks plus the null block
HOST = 20
HOT = 3


def manager(caching: bool = False, **overrides) -> TieredKVCacheManager:
    settings = {"hot_blocks": HOT, "keep_tail_blocks": 1, "max_requests": 4, **overrides}
    return TieredKVCacheManager(TierSizes(DEVICE, HOST), BLOCK, caching, **settings)


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(temperature=0.0), max_tokens=4)


def written(kv: TieredKVCacheManager, req: Request, count: int) -> None:
    """What the scheduler does after a step wrote ``count`` tokens of ``req``."""
    req.num_computed_tokens = count
    kv.publish_computed_blocks(req, count)


def test_pressure_moves_the_oldest_written_blocks_and_keeps_the_tail():
    kv = manager()
    a = request("a", list(range(40)))
    assert kv.allocate(a, 40)
    written(kv, a, 40)
    before = list(kv.block_ids("a"))
    b = request("b", list(range(16)))
    assert kv.allocate(b, 16)  # 4 blocks with 2 free: 5 of a's move, 3 of them pay for a's hot buffer
    after = list(kv.block_ids("a"))
    assert all(page >= DEVICE for page in after[:5]) and after[5:] == before[5:]
    pending = kv.take_pending()
    assert [m.device_id for m in pending.migrations] == before[:5]
    assert [m.host_id for m in pending.migrations] == after[:5]
    assert len(pending.new_leases) == 1 and len(pending.new_leases[0].pages) == HOT
    assert kv.handle("a") == pending.new_leases[0].handle and kv.handle("b") == -1
    assert kv.num_spilled_blocks == 5 and kv.pool.num_free_blocks == 0
    kv.check_invariants()


def test_blocks_not_yet_written_or_held_twice_stay():
    kv = manager(caching=True)
    shared = list(range(32))
    a = request("a", [*shared, 99, 98, 97])
    assert kv.allocate(a, 35)
    written(kv, a, 35)  # 8 full blocks published
    c = request("c", [*shared, 5, 6, 7])
    prefix = kv.find_cached_prefix(c)
    assert len(prefix) == 8
    assert kv.allocate(c, 3, prefix)  # shares a's 8 blocks
    c.num_computed_tokens = 32
    d = request("d", list(range(100, 108)))
    assert kv.allocate(d, 8)  # the last 2 free blocks, not written yet
    shared_ids = set(kv.block_ids("a")[:8])
    e = request("e", list(range(200, 216)))
    assert not kv.allocate(e, 16)  # nothing may move: shared, the tails, unwritten blocks
    assert set(kv.block_ids("a")[:8]) == shared_ids and not kv.take_pending().migrations
    kv.check_invariants()


def test_a_prefix_hit_stays_even_when_its_other_holder_is_gone():
    kv = manager(caching=True)
    shared = list(range(40))
    a = request("a", [*shared, 1])
    assert kv.allocate(a, 41)
    written(kv, a, 41)
    kv.free(a)
    c = request("c", [*shared, 2])
    prefix = kv.find_cached_prefix(c)
    assert len(prefix) == 10 and kv.allocate(c, 1, prefix)
    written(kv, c, 41)
    assert not kv.allocate(request("d", list(range(300, 308))), 8)  # 1 free block, and c's blocks are a hit
    assert not kv.take_pending().migrations


def test_a_request_too_short_to_pay_for_a_hot_buffer_is_left_alone():
    kv = manager(hot_blocks=9)
    a = request("a", list(range(40)))
    assert kv.allocate(a, 40)
    written(kv, a, 40)  # 9 movable blocks, all of them would go to its hot buffer
    b = request("b", list(range(12)))
    assert not kv.allocate(b, 12)
    assert kv.handle("a") == -1 and not kv.take_pending().migrations


def test_free_gives_back_host_slots_hot_pages_and_drops_copies_not_yet_run():
    kv = manager()
    a = request("a", list(range(40)))
    assert kv.allocate(a, 40)
    written(kv, a, 40)
    assert kv.allocate(request("b", list(range(16))), 16)
    handle = kv.handle("a")
    kv.free(a)
    assert kv.host.num_free_blocks == HOST and kv.handle("a") == -1
    assert not kv.take_pending().migrations  # a's copies never ran: their host slots may be reused at once
    assert kv.pool.num_free_blocks == DEVICE - 1 - 4
    a2 = request("a2", list(range(40)))
    assert kv.allocate(a2, 40 - 16) and kv.allocate(request("c", list(range(8))), 8)
    written(kv, a2, 24)
    assert kv.allocate(request("d", list(range(8))), 8)
    assert kv.handle("a2") == handle  # the handle was recycled
    kv.check_invariants()


def test_capacity_counts_both_tiers():
    kv = manager()
    assert kv.num_free_blocks == DEVICE - 1 + HOST
    assert kv.capacity_tokens == (DEVICE - 1 + HOST) * BLOCK
    with pytest.raises(ValueError, match="hot_blocks"):
        manager(hot_blocks=0)


def test_host_blocks_carry_their_slot():
    kv = manager()
    a = request("a", list(range(40)))
    assert kv.allocate(a, 40)
    written(kv, a, 40)
    assert kv.allocate(request("b", list(range(16))), 16)
    moved = [block for block in kv.held_blocks("a") if isinstance(block, HostBlock)]
    assert [block.block_id - DEVICE for block in moved] == [block.host_slot for block in moved]
    assert kv.host_usage == pytest.approx(len(moved) / HOST)
