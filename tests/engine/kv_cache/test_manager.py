"""KV cache manager: prefix hits, allocation with a reserve, publication after compute, release."""

from m3stack.engine.kv_cache.manager import KVCacheManager

BLOCK = 4


def _run_prefill(manager: KVCacheManager, request) -> None:
    """Allocate and 'compute' the whole prompt, as a scheduler step followed by its update would."""
    cached = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - len(cached) * BLOCK, cached)
    request.num_computed_tokens = request.num_tokens
    manager.publish_computed_blocks(request, request.num_tokens)


def test_a_published_prefix_is_found_by_a_later_request(new_request):
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = new_request(list(range(10)))
    _run_prefill(manager, first)
    second = new_request([*range(10), 99, 98, 97])
    hits = manager.find_cached_prefix(second)
    assert [b.block_id for b in hits] == manager.block_ids(first.request_id)[:2].tolist()  # the 2 full blocks
    manager.check_invariants()


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute(new_request):
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    _run_prefill(manager, new_request(list(range(8))))
    again = new_request(list(range(8)))
    assert len(manager.find_cached_prefix(again)) == 1  # block 1 holds the last token: recompute it


def test_nothing_is_shared_before_publication(new_request):
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = new_request(list(range(12)))
    assert manager.allocate(first, 12)
    # Allocated but not computed yet: another request must not read these pages.
    assert manager.find_cached_prefix(new_request(list(range(13)))) == []
    first.num_computed_tokens = 8  # a first chunk ran
    manager.publish_computed_blocks(first, 8)
    assert len(manager.find_cached_prefix(new_request(list(range(13))))) == 2


def test_allocation_respects_the_reserve_and_changes_nothing_on_failure(new_request):
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK)  # 4 usable
    request = new_request(list(range(12)))
    assert not manager.allocate(request, 12, reserve=2)
    assert manager.num_free_blocks == 4 and manager.num_held_blocks(request.request_id) == 0
    assert manager.allocate(request, 12, reserve=1)
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_freed_blocks_stay_cached_and_shared_blocks_survive_one_owner(new_request):
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = new_request(list(range(9)))
    _run_prefill(manager, first)
    second = new_request(list(range(9)))
    _run_prefill(manager, second)  # shares blocks 0 and 1 with the first
    shared = manager.block_ids(first.request_id)[:2].tolist()
    assert manager.block_ids(second.request_id)[:2].tolist() == shared
    manager.free(first)
    manager.check_invariants()
    assert all(manager.pool.blocks[i].ref_count == 1 for i in shared)
    manager.free(second)
    manager.check_invariants()
    assert manager.num_free_blocks == 7
    assert len(manager.find_cached_prefix(new_request(list(range(9))))) == 2


def test_eviction_takes_a_freed_request_tail_before_its_prefix(new_request):
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable
    request = new_request(list(range(12)))
    _run_prefill(manager, request)
    manager.free(request)
    hog = new_request(list(range(100, 104)))
    assert manager.allocate(hog, 4)  # needs one block: evicts block 2 (the tail), not block 0
    again = new_request([*range(12), 5])
    assert len(manager.find_cached_prefix(again)) == 2


def test_idle_hits_count_against_free_space(new_request):
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable
    first = new_request(list(range(8)))
    _run_prefill(manager, first)
    manager.free(first)  # blocks cached and idle: all 3 usable blocks are "free"
    second = new_request([*range(8), 1, 2, 3, 4, 5])
    hits = manager.find_cached_prefix(second)
    assert len(hits) == 2
    # 2 idle hits + 2 fresh blocks (13 tokens -> 4 blocks) > 3 free.
    assert manager.num_new_blocks(second, 5, hits) == 4
    assert not manager.allocate(second, 5, hits)
    manager.check_invariants()


def test_prefix_caching_off_finds_nothing(new_request):
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    _run_prefill(manager, new_request(list(range(9))))
    assert manager.find_cached_prefix(new_request(list(range(9)))) == []
