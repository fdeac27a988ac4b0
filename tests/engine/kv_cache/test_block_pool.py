"""Block pool: allocation, reference counts, the O(1) LRU free list, the hash index, and its invariant checker."""

import random

import pytest

from m3stack.engine.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in {b.block_id for b in blocks}
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)
    pool.check_invariants()


def test_release_puts_blocks_at_the_tail_in_the_given_order():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.release([c, b, a])  # a request's tail first
    # Untouched blocks 4, 5 come first (they were free longer), then c, b, a.
    assert [blk.block_id for blk in pool.free_queue] == [4, 5, c.block_id, b.block_id, a.block_id]
    pool.check_invariants()


def test_cached_blocks_are_found_until_evicted_least_recent_first():
    pool = BlockPool(4)
    first, second, third = pool.allocate(3)
    pool.cache(first, b"h1")
    pool.cache(second, b"h2")
    pool.release([first])
    pool.release([second])
    assert pool.lookup(b"h1") is first and pool.lookup(b"h2") is second
    # The next allocation evicts the least recently freed cached block: first.
    pool.release([third])
    (taken,) = pool.allocate(1)
    assert taken is first
    assert pool.lookup(b"h1") is None and first.block_hash is None
    assert pool.lookup(b"h2") is second
    pool.check_invariants()


def test_touch_takes_an_idle_cached_block_out_of_the_free_list():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"x")
    pool.release([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    pool.touch([block])  # a second request shares it
    assert block.ref_count == 2 and pool.num_free_blocks == 2
    pool.release([block])
    assert pool.num_free_blocks == 2  # still held once
    pool.release([block])
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_first_published_block_wins_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") is a and b.block_hash is None


def test_double_free_is_an_error():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([block])


def test_eviction_hook_sees_the_hash_of_the_evicted_block():
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = lambda block, block_hash: evicted.append((block.block_id, block_hash))
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.release([a, b])
    pool.allocate(2)
    assert evicted == [(a.block_id, b"ha")]


def test_disabled_caching_never_indexes():
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    assert pool.lookup(b"h") is None and not pool.cached


def test_invariant_checker_catches_corruption():
    pool = BlockPool(4)
    a, _ = pool.allocate(2)
    pool.check_invariants({a.block_id: 1, 2: 1})
    with pytest.raises(AssertionError, match="owners hold 0"):
        pool.check_invariants({2: 1})  # a leak: block a is held by nobody
    a.ref_count = 0  # held count dropped without returning it to the free list
    with pytest.raises(AssertionError, match="membership"):
        pool.check_invariants()


def test_free_queue_matches_a_list_model_under_random_operations():
    rng = random.Random(1234)
    blocks = [KVBlock(i) for i in range(50)]
    queue = FreeBlockQueue(blocks)
    model = list(blocks)
    for _ in range(2000):
        action = rng.random()
        if action < 0.35 and model:
            assert queue.popleft() is model.pop(0)
        elif action < 0.7 and model:
            victim = rng.choice(model)
            queue.remove(victim)
            model.remove(victim)
        else:
            outside = [b for b in blocks if b not in model]
            if outside:
                block = rng.choice(outside)
                queue.append(block)
                model.append(block)
        assert len(queue) == len(model)
    assert list(queue) == model
    with pytest.raises(ValueError, match="already in the free list"):
        if model:
            queue.append(model[0])
        else:
            raise ValueError("already in the free list")
