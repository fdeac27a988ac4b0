"""LRU cache of processed media, keyed by content hash plus every setting that shapes the output."""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from .plans import Plan


def content_key(data: bytes, kind: str, settings: str) -> str:
    """The cache key and the engine's ``content_hash``: the bytes, the modality and the settings fingerprint."""
    digest = hashlib.blake2b(data, digest_size=20)
    digest.update(f"\0{kind}\0{settings}".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class CachedItem:
    plan: Plan
    shape: tuple[int, ...]
    payload: bytes


class ProcessedCache:
    """Holds at most ``capacity_bytes`` of payloads; 0 disables it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, CachedItem] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> CachedItem | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item

    def put(self, key: str, item: CachedItem) -> None:
        size = len(item.payload)
        if size > self.capacity_bytes:
            return
        previous = self._items.pop(key, None)
        if previous is not None:
            self._bytes -= len(previous.payload)
        self._items[key] = item
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, evicted = self._items.popitem(last=False)
            self._bytes -= len(evicted.payload)
