"""The KV bookkeeping's two seams with the runtime: what it reads of a request, and what the scheduler asks of it.

The block pool, the managers and the prefix-cache keys sit below the runtime that owns requests
(``engine.runtime.request.Request``), so they name here the fields they read (``KVRequest``); a runtime
``Request`` has them all.  The scheduler, the step loop's statistics and the warm-up see a manager as ``KVManager``:
the paged one (``manager.KVCacheManager``) and the one with a host tier (``engine.offload.tiered_manager``) both are.
"""

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from m3stack.engine.kv_cache.block_pool import BlockPool, KVBlock


class CachedItem(Protocol):
    """A multimodal item behind some prompt positions: its content hash keys every block its span overlaps."""

    @property
    def content_hash(self) -> str: ...

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the prompt positions the item touches."""
        ...


class KVRequest(Protocol):
    """One request as its page table and prefix-cache keys see it."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """The prompt, then the generated tokens (trailing placeholders for tokens still being sampled)."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (the placeholders excluded): only those are hashed."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the paged cache."""
        ...

    @property
    def block_hashes(self) -> list[bytes]:
        """The prefix-cache hash chain of the full blocks hashed so far (``prefix_cache.extend_block_hashes``)."""
        ...

    @property
    def mm_inputs(self) -> Sequence[CachedItem]: ...

    @property
    def cache_salt(self) -> str: ...

    @property
    def prompt_logprobs(self) -> object | None:
        """Not None when the request wants prompt logprobs: every prompt token must then be computed."""
        ...


class KVManager(Protocol):
    """Per-request page tables over the device pool, as the scheduler, the engine's statistics and warm-up use them.

    Capacity (``num_free_blocks``, ``capacity_tokens``) counts every block a request can still grow into; ``pool``
    is the device pool alone."""

    @property
    def block_size(self) -> int: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def pool(self) -> BlockPool: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of the device pool's usable blocks held by requests."""
        ...

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def max_chunk_tokens(self) -> int:
        """The most new tokens one step may give a request."""
        ...

    @property
    def prefix_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache at first admission."""
        ...

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens found there."""
        ...

    def can_admit(self, context_blocks: int, reserve: int) -> bool: ...

    def block_ids(self, request_id: str) -> np.ndarray: ...

    def num_held_blocks(self, request_id: str) -> int: ...

    def find_cached_prefix(self, request: KVRequest) -> list[KVBlock]: ...

    def num_new_blocks(self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()) -> int: ...

    def allocate(
        self, request: KVRequest, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = (), reserve: int = 0
    ) -> bool: ...

    def publish_computed_blocks(self, request: KVRequest, num_computed: int) -> None: ...

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None: ...

    def reset_prefix_cache(self) -> None:
        """Forget the idle blocks' cached content and the prefix counters (after warm-up)."""
        ...

    def free(self, request: KVRequest) -> None: ...

    def check_invariants(self) -> None: ...
