"""Routing policies and the approximate prefix tree."""

import random
import secrets
from dataclasses import dataclass

import pytest

from m3stack.gateway.routing.policies import LeastInflight, PrefixAware, make_policy
from m3stack.gateway.routing.prefix_tree import PrefixTree


@dataclass
class Engine:
    address: str
    inflight: int = 0
    waiting: int = 0
    kv_block_size: int = 4


def test_least_inflight_picks_the_least_loaded_then_the_shortest_queue_then_rotates():
    policy = LeastInflight()
    a, b, c = Engine("a", 3), Engine("b", 1, waiting=5), Engine("c", 1, waiting=0)
    assert policy.choose([a, b, c], []) is c
    b.waiting = 0
    picks = {policy.choose([a, b, c], []).address for _ in range(4)}
    assert picks == {"b", "c"}


def test_prefix_tree_matches_whole_blocks_per_engine():
    tree = PrefixTree(block_size=4)
    prompt = list(range(14))
    tree.insert(prompt, "a")
    tree.insert(prompt[:8] + [99] * 6, "b")
    assert tree.match(prompt) == {"a": 12, "b": 8}
    assert tree.match([7, *prompt]) == {}
    assert tree.match(prompt[:3]) == {}, "shorter than a block: nothing to share"


def test_prefix_tree_evicts_leaves_before_their_ancestors():
    tree = PrefixTree(block_size=2, max_nodes=4)
    tree.insert([1, 1, 2, 2, 3, 3], "a")
    tree.insert([9, 9], "b")
    tree.insert([8, 8], "c")
    assert len(tree) == 4
    # The deepest node of the first prompt went first: its first two blocks still match.
    assert tree.match([1, 1, 2, 2, 3, 3]) == {"a": 4}


def test_prefix_tree_against_a_brute_force_reference():
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    tree = PrefixTree(block_size=3, max_nodes=10_000)
    sent: dict[str, list[list[int]]] = {"a": [], "b": [], "c": []}
    for _ in range(200):
        engine = rng.choice(list(sent))
        prompt = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        tree.insert(prompt, engine)
        sent[engine].append(prompt)
    for _ in range(200):
        query = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        expected = {}
        for engine, prompts in sent.items():
            best = max((common_blocks(query, p, 3) for p in prompts), default=0)
            if best:
                expected[engine] = best
        assert tree.match(query) == expected, seed


def common_blocks(a: list[int], b: list[int], size: int) -> int:
    length = 0
    while length + size <= min(len(a), len(b)) and a[length : length + size] == b[length : length + size]:
        length += size
    return length


def test_prefix_aware_follows_the_cache_until_the_load_says_otherwise():
    policy = PrefixAware(load_penalty=0.1, block_size=4)
    a, b = Engine("a"), Engine("b")
    system_prompt = list(range(100, 140))
    first = policy.choose([a, b], [*system_prompt, 1, 2, 3, 4])
    policy.on_routed(first, [*system_prompt, 1, 2, 3, 4])
    other = b if first is a else a
    for suffix in ([5, 6, 7, 8], [9, 10, 11, 12]):
        assert policy.choose([a, b], system_prompt + suffix) is first
    first.inflight, other.inflight = 10, 0
    assert policy.choose([a, b], [*system_prompt, 13, 14, 15, 16]) is other
    first.inflight, other.inflight = 10, 9
    assert policy.choose([a, b], [*system_prompt, 13, 14, 15, 16]) is first


def test_prefix_aware_takes_the_block_size_from_the_engines():
    policy = PrefixAware()
    engine = Engine("a", kv_block_size=8)
    policy.on_routed(engine, list(range(20)))
    assert policy.tree is not None and policy.tree.block_size == 8


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
