"""Routing policies: pick one engine among those that can take a request now.

``least-inflight`` (default) sends a request to the engine with the fewest requests this gateway
has open on it; ties go to the engine with the shorter reported queue, then round-robin.
``prefix-aware`` prefers the engine whose prefix cache most likely holds the prompt's beginning:

    score = matched prefix / prompt length - load_penalty * (in-flight - least in-flight) / (least in-flight + 1)

The load term is the engine's excess over the least loaded candidate, relative to that engine's load:
a shared prefix keeps traffic together while loads are comparable (10 vs 9 costs 0.1 * load_penalty),
and a hot spot sheds it (10 vs 0 costs 10 * load_penalty, more than any match ratio can win back
with the default 0.1).
"""

import itertools
from collections.abc import Sequence
from typing import Protocol

from m3stack.gateway.routing.prefix_tree import PrefixTree

DEFAULT_BLOCK_SIZE = 16


class Candidate(Protocol):
    """What a policy reads of an engine (``EngineClient`` satisfies it)."""

    address: str
    inflight: int

    @property
    def waiting(self) -> int: ...

    @property
    def kv_block_size(self) -> int: ...


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> Candidate: ...

    def on_routed(self, engine: Candidate, prompt_ids: Sequence[int]) -> None: ...


class LeastInflight:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        least = min((c.inflight, c.waiting) for c in candidates)
        tied = [c for c in candidates if (c.inflight, c.waiting) == least]
        return tied[next(self._turn) % len(tied)]

    def on_routed(self, engine: Candidate, prompt_ids: Sequence[int]) -> None:
        return None


class PrefixAware:
    """``block_size=None`` takes the KV block size of the first engine it routes to."""

    def __init__(self, load_penalty: float = 0.1, block_size: int | None = None, max_nodes: int = 200_000) -> None:
        self.load_penalty = load_penalty
        self._block_size = block_size
        self._max_nodes = max_nodes
        self.tree: PrefixTree | None = None
        self._fallback = LeastInflight()

    def _tree(self, candidates: Sequence[Candidate]) -> PrefixTree:
        if self.tree is None:
            size = self._block_size or next(
                (c.kv_block_size for c in candidates if c.kv_block_size), DEFAULT_BLOCK_SIZE
            )
            self.tree = PrefixTree(size, self._max_nodes)
        return self.tree

    def scores(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> dict[str, float]:
        matched = self._tree(candidates).match(prompt_ids)
        least = min(c.inflight for c in candidates)
        length = max(1, len(prompt_ids))
        return {
            c.address: matched.get(c.address, 0) / length - self.load_penalty * (c.inflight - least) / (least + 1)
            for c in candidates
        }

    def choose(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        scores = self.scores(candidates, prompt_ids)
        best = max(scores.values())
        tied = [c for c in candidates if scores[c.address] == best]
        return tied[0] if len(tied) == 1 else self._fallback.choose(tied, prompt_ids)

    def on_routed(self, engine: Candidate, prompt_ids: Sequence[int]) -> None:
        self._tree([engine]).insert(prompt_ids, engine.address)


POLICIES = ("least-inflight", "prefix-aware")


def make_policy(name: str, load_penalty: float = 0.1, block_size: int | None = None) -> RoutingPolicy:
    if name == "least-inflight":
        return LeastInflight()
    if name == "prefix-aware":
        return PrefixAware(load_penalty=load_penalty, block_size=block_size)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
