"""An approximate radix tree over token ids: which engines recently saw which prompt prefixes.

Edges are fixed blocks of ``block_size`` tokens (the engine's KV block: its prefix cache shares
only full blocks, so finer matching would promise hits that cannot happen).  A node is named by
the hash chain of the blocks from the root, so the tree is stored flat, in one dict kept in LRU
order and capped at ``max_nodes``.  It is approximate on purpose: it records where requests were
sent, not what the engines still hold, and a rare hash collision only costs a routing choice.
"""

from collections import OrderedDict
from collections.abc import Sequence


class PrefixTree:
    def __init__(self, block_size: int, max_nodes: int = 200_000) -> None:
        if block_size <= 0 or max_nodes <= 0:
            raise ValueError("block_size and max_nodes must be positive")
        self.block_size = block_size
        self.max_nodes = max_nodes
        self._nodes: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def _chain(self, token_ids: Sequence[int]) -> list[int]:
        size = self.block_size
        hashes = []
        parent = 0
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, tuple(token_ids[start : start + size])))
            hashes.append(parent)
        return hashes

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Engine -> number of leading prompt tokens it has seen (whole blocks)."""
        matched: dict[str, int] = {}
        candidates: set[str] | None = None
        for depth, node in enumerate(self._chain(token_ids), start=1):
            engines = self._nodes.get(node)
            if not engines:
                break
            candidates = set(engines) if candidates is None else candidates & engines
            if not candidates:
                break
            for engine in candidates:
                matched[engine] = depth * self.block_size
        return matched

    def insert(self, token_ids: Sequence[int], engine: str) -> None:
        nodes = self._nodes
        # Deepest first, so that ancestors end up more recent and eviction takes leaves before them.
        for node in reversed(self._chain(token_ids)):
            engines = nodes.get(node)
            if engines is None:
                nodes[node] = {engine}
            else:
                engines.add(engine)
                nodes.move_to_end(node)
        while len(nodes) > self.max_nodes:
            nodes.popitem(last=False)
