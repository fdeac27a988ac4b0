"""Paged KV cache tensors, one set per layer; page = MSA block = ``block_size`` tokens.

Layout (design/msa.md): K and V are HND ``[num_pages, Hkv, block_size, D]`` so a (page, KV head)
pair is one contiguous ``block_size x D`` tile, which lets sparse decode view the cache as
``[num_pages * Hkv, 1, block_size, D]`` for free.  MSA layers also keep the index keys
``[num_pages, block_size, d]`` (one shared index-key head).  All layers share one page table.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    index_head_dim: int
    sparse_layers: tuple[bool, ...]  # per layer: True for MSA (has an index-key cache)
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes across all layers (K + V, plus index keys on MSA layers)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * self.num_kv_heads * self.block_size * self.head_dim
        index = self.block_size * self.index_head_dim
        return itemsize * sum(kv + (index if sparse else 0) for sparse in self.sparse_layers)


@dataclass
class LayerKVCache:
    key: torch.Tensor  # [num_pages, Hkv, block_size, D]
    value: torch.Tensor  # [num_pages, Hkv, block_size, D]
    index_key: torch.Tensor | None  # [num_pages, block_size, d] on MSA layers, else None

    @property
    def num_pages(self) -> int:
        return int(self.key.shape[0])


def allocate_kv_cache(spec: KVCacheSpec, num_pages: int, device: torch.device | str) -> list[LayerKVCache]:
    """Allocate every layer's cache.  Contents start uninitialized: only written slots are ever read."""
    shape = (num_pages, spec.num_kv_heads, spec.block_size, spec.head_dim)
    layers = []
    for sparse in spec.sparse_layers:
        index_key = (
            torch.empty((num_pages, spec.block_size, spec.index_head_dim), dtype=spec.dtype, device=device)
            if sparse
            else None
        )
        layers.append(
            LayerKVCache(
                key=torch.empty(shape, dtype=spec.dtype, device=device),
                value=torch.empty(shape, dtype=spec.dtype, device=device),
                index_key=index_key,
            )
        )
    return layers
