"""Paged KV cache tensors, one set per layer; page = MSA block = ``block_size`` tokens.

Layout (docs/msa.md#cache-layout): K and V are HND ``[num_pages, Hkv, block_size, D]`` so a (page, KV head)
pair is one contiguous ``block_size x D`` tile, which lets sparse decode view the cache as
``[num_pages * Hkv, 1, block_size, D]`` for free.  MSA layers also keep the index keys
``[num_pages, block_size, d]`` (one shared index-key head).  All layers share one page table.

An fp8 (e4m3) KV cache (``KVCacheSpec.kv_dtype``) holds K and V as they are, clamped to e4m3's range (a scale of
1 per tensor, what an uncalibrated fp8 cache uses: RMS-normed keys and the values of a trained model sit far inside
+-448, and e4m3 keeps 3 mantissa bits of each); kernels widen the tiles they load.

An fp8 (e4m3) k-index (``KVCacheSpec.index_dtype``) halves the decode scan's bytes.  Each index key is stored
as ``key / scale`` with its own float32 scale (``max |key| / 448``, the e4m3 range), so no token's key saturates
or drowns in the format's few mantissa bits whatever its norm.  The scales live inside their page: a page of
index keys is ``B x d`` fp8 bytes followed by ``B`` float32 scales (``index_page_bytes``), so whatever moves or
copies index pages (CPU offload's migrations, a page copy) moves the scales with them.  ``index_key`` and
``index_key_scale`` are strided views of those pages.
"""

from dataclasses import dataclass

import torch

FP8_INDEX_DTYPE = torch.float8_e4m3fn
# ``--index-dtype`` names: auto keeps the cache's dtype.
INDEX_DTYPES = {"auto": None, "fp8_e4m3": FP8_INDEX_DTYPE}
FP8_KV_DTYPE = torch.float8_e4m3fn
# ``--kv-cache-dtype`` names: auto keeps the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8_KV_DTYPE}
# Largest finite e4m3 value: a key's largest component maps to it.
FP8_E4M3_MAX = 448.0
_SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    index_head_dim: int
    sparse_layers: tuple[bool, ...]  # per layer: True for MSA (has an index-key cache)
    dtype: torch.dtype
    index_dtype: torch.dtype | None = None  # the k-index's: None (as ``dtype``) or fp8 e4m3 with per-token scales
    kv_dtype: torch.dtype | None = None  # K and V: None (as ``dtype``) or fp8 e4m3 (clamped, scale 1)

    def __post_init__(self) -> None:
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")
        if self.index_dtype not in (None, self.dtype, FP8_INDEX_DTYPE):
            raise ValueError(
                f"index_dtype must be the cache's {self.dtype} or {FP8_INDEX_DTYPE}, not {self.index_dtype}"
            )
        if self.kv_dtype not in (None, self.dtype, FP8_KV_DTYPE):
            raise ValueError(f"kv_dtype must be the cache's {self.dtype} or {FP8_KV_DTYPE}, not {self.kv_dtype}")

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The dtype K and V are stored in."""
        return self.kv_dtype or self.dtype

    @property
    def fp8_index(self) -> bool:
        return self.index_dtype == FP8_INDEX_DTYPE

    @property
    def index_page_bytes(self) -> int:
        """Bytes of one page of index keys (with its scales for an fp8 k-index)."""
        if self.fp8_index:
            return self.block_size * (self.index_head_dim + _SCALE_BYTES)
        return self.block_size * self.index_head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one page of one layer's K and V."""
        itemsize = torch.empty((), dtype=self.kv_storage_dtype).element_size()
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes across all layers (K + V, plus index keys on MSA layers)."""
        return sum(self.kv_page_bytes + (self.index_page_bytes if sparse else 0) for sparse in self.sparse_layers)


@dataclass
class LayerKVCache:
    key: torch.Tensor  # [num_pages, Hkv, block_size, D]
    value: torch.Tensor  # [num_pages, Hkv, block_size, D]
    index_key: torch.Tensor | None  # [num_pages, block_size, d] on MSA layers, else None
    index_key_scale: torch.Tensor | None = None  # [num_pages, block_size] float32 with an fp8 k-index

    def __post_init__(self) -> None:
        fp8 = self.index_key is not None and self.index_key.dtype == FP8_INDEX_DTYPE
        if fp8 != (self.index_key_scale is not None):
            raise ValueError("an fp8 k-index needs its scales (index_key_scale), and only an fp8 k-index has them")

    @property
    def num_pages(self) -> int:
        return int(self.key.shape[0])


def index_key_views(pages: torch.Tensor, block_size: int, index_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(index_key, index_key_scale)`` of raw index pages ``[..., index_page_bytes]`` (uint8, fp8 k-index) or the
    keys themselves ``[..., B, d]`` (no scales)."""
    if pages.dtype != torch.uint8:
        return pages, None
    page_bytes = pages.shape[-1]
    if page_bytes != block_size * (index_dim + _SCALE_BYTES):
        raise ValueError(f"raw index pages of {page_bytes} bytes do not hold {block_size} x {index_dim} fp8 + scales")
    keys = pages[..., : block_size * index_dim].view(FP8_INDEX_DTYPE).unflatten(-1, (block_size, index_dim))
    scales = pages[..., block_size * index_dim :].view(torch.float32)
    return keys, scales


def allocate_index_pages(spec: KVCacheSpec, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Index pages of leading ``shape`` (e.g. ``(num_pages,)``): the keys ``[*shape, B, d]`` in the cache's dtype, or
    raw fp8 pages with their scales ``[*shape, index_page_bytes]`` uint8 (``index_key_views``)."""
    if spec.fp8_index:
        return torch.empty((*shape, spec.index_page_bytes), dtype=torch.uint8, device=device)
    return torch.empty((*shape, spec.block_size, spec.index_head_dim), dtype=spec.dtype, device=device)


def allocate_kv_cache(spec: KVCacheSpec, num_pages: int, device: torch.device | str) -> list[LayerKVCache]:
    """Allocate every layer's cache.  Contents start uninitialized: only written slots are ever read."""
    shape = (num_pages, spec.num_kv_heads, spec.block_size, spec.head_dim)
    layers = []
    for sparse in spec.sparse_layers:
        index_key, index_key_scale = None, None
        if sparse:
            pages = allocate_index_pages(spec, (num_pages,), device)
            index_key, index_key_scale = index_key_views(pages, spec.block_size, spec.index_head_dim)
        layers.append(
            LayerKVCache(
                key=torch.empty(shape, dtype=spec.kv_storage_dtype, device=device),
                value=torch.empty(shape, dtype=spec.kv_storage_dtype, device=device),
                index_key=index_key,
                index_key_scale=index_key_scale,
            )
        )
    return layers


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` ``[..., d]`` -> (fp8 e4m3 ``keys / scale``, float32 ``scale`` ``[...]``), ``scale = max |key| / 448``
    (a zero key gets scale 1).  What the stores write; ``dequantize_index_keys`` inverts it."""
    amax = keys.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (keys.float() / scale[..., None]).to(FP8_INDEX_DTYPE), scale


def dequantize_index_keys(keys: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Index keys as the scan scores them: float32 ``keys * scale`` (the keys themselves without scales)."""
    return keys.float() if scale is None else keys.float() * scale[..., None]


def check_index_scale(index_key: torch.Tensor, index_key_scale: torch.Tensor | None) -> None:
    """Scales go with an fp8 k-index ``[pages, B, d]`` as float32 ``[pages, B]`` with a contiguous last dim."""
    if index_key_scale is None:
        return
    if index_key.dtype != FP8_INDEX_DTYPE:
        raise ValueError(f"index-key scales go with an fp8 k-index, not {index_key.dtype}")
    if (index_key_scale.dtype != torch.float32 or tuple(index_key_scale.shape) != tuple(index_key.shape[:2])
            or index_key_scale.stride(-1) != 1):  # fmt: skip
        raise ValueError(f"index-key scales must be float32 {tuple(index_key.shape[:2])} with a contiguous last dim, "
                         f"got {index_key_scale.dtype} {tuple(index_key_scale.shape)}")  # fmt: skip


def fp8_index_from(index_key: torch.Tensor, pages_at_once: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The index keys ``[pages, B, d]`` as an fp8 k-index: ``(index_key, index_key_scale)`` views of fresh raw pages
    (quantized a few thousand pages at a time, so a 1M-token cache needs no full-size temporaries)."""
    pages, block_size, dim = index_key.shape
    raw = torch.empty((pages, block_size * (dim + _SCALE_BYTES)), dtype=torch.uint8, device=index_key.device)
    keys, scales = index_key_views(raw, block_size, dim)
    for start in range(0, pages, pages_at_once):
        stop = start + pages_at_once
        keys[start:stop], scales[start:stop] = quantize_index_keys(index_key[start:stop])
    return keys, scales


def to_kv_cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the cache stores them: cast, and for fp8 first clamped to e4m3's range (a cast would make NaN)."""
    if dtype == FP8_KV_DTYPE:
        return values.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return values.to(dtype)
