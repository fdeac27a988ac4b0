"""Vision-encoder outputs keyed by the item's content hash, bounded in embedding rows.

The vision tower runs once per image or video; a prompt's text is then prefilled in chunks that
each read a slice of the cached embeddings.  An entry is pinned while some request still has to
prefill positions it covers; idle entries stay until space is needed (LRU), so the same image in a
later request (a multi-turn chat) is not encoded again.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    num_embeds: int
    embeds: torch.Tensor | None = None  # None between reservation and the encoder step
    users: set[str] = field(default_factory=set)


class EncoderCache:
    def __init__(self, capacity_embeds: int) -> None:
        self.capacity_embeds = capacity_embeds
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.used_embeds = 0
        self.hits = 0  # lookups answered without running the encoder
        self.misses = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, num_embeds: int) -> bool:
        """Whether an item of this size could ever be cached."""
        return num_embeds <= self.capacity_embeds

    def acquire(self, content_hash: str, request_id: str) -> bool:
        """Pin an existing entry for ``request_id``; False when it is not cached."""
        entry = self._entries.get(content_hash)
        if entry is None:
            return False
        if request_id not in entry.users:
            self.hits += 1
        entry.users.add(request_id)
        self._entries.move_to_end(content_hash)
        return True

    def reserve(self, content_hash: str, num_embeds: int, request_id: str) -> bool:
        """Make room for an item the encoder will produce this step; False when pinned entries leave no room."""
        if content_hash in self._entries:
            return self.acquire(content_hash, request_id)
        if not self._make_room(num_embeds):
            return False
        self._entries[content_hash] = _Entry(num_embeds=num_embeds, users={request_id})
        self.used_embeds += num_embeds
        self.misses += 1
        return True

    def put(self, content_hash: str, embeds: torch.Tensor) -> None:
        entry = self._entries[content_hash]
        if int(embeds.shape[0]) != entry.num_embeds:
            raise ValueError(f"encoder produced {embeds.shape[0]} embeddings for an item expecting {entry.num_embeds}")
        entry.embeds = embeds

    def get(self, content_hash: str) -> torch.Tensor:
        entry = self._entries[content_hash]
        if entry.embeds is None:
            raise KeyError(f"encoder output for {content_hash!r} was reserved but never computed")
        return entry.embeds

    def release(self, content_hash: str, request_id: str) -> None:
        entry = self._entries.get(content_hash)
        if entry is None:
            return
        entry.users.discard(request_id)
        if entry.embeds is None and not entry.users:
            # Reserved for a step that never ran (the request left first): nothing worth keeping.
            self._drop(content_hash)

    def _make_room(self, num_embeds: int) -> bool:
        if self.used_embeds + num_embeds <= self.capacity_embeds:
            return True
        idle = [key for key, entry in self._entries.items() if not entry.users]  # oldest first
        freeable = sum(self._entries[key].num_embeds for key in idle)
        if self.used_embeds - freeable + num_embeds > self.capacity_embeds:
            return False
        for key in idle:
            if self.used_embeds + num_embeds <= self.capacity_embeds:
                break
            self._drop(key)
        return True

    def _drop(self, content_hash: str) -> None:
        entry = self._entries.pop(content_hash)
        self.used_embeds -= entry.num_embeds
