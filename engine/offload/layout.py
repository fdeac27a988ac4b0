"""Where an offloaded block lives: what stays on the device, what goes to pinned host memory.

Block ids come in two tiers.  Ids ``[0, num_device)`` are device blocks: their whole KV is on the
device, as without offload (id 0 is the reserved null page).  Ids ``[num_device, num_device +
num_host)`` are host blocks (host slot ``id - num_device``): the K/V of their MSA layers sit in pinned
host memory, while what every step reads in full stays on the device under the same id: the k-index
of every MSA layer (the decode scan reads every block's index keys) and the K/V of the dense
(``full_attention``) layers.  For M3 that is ``d = 128`` index values per token and MSA layer against
``2 * Hkv * D = 1024`` K/V values, plus 3 dense layers of 60: a host block costs the device ~1/6 of a
device block.

Tensors (``TieredKVCache``):

* MSA layers' K/V: ``device_sparse [L_msa, 2, num_device, Hkv, B, D]``; each layer's ``key`` / ``value``
  is a contiguous view of it, so the attention kernels see the usual HND caches;
* MSA layers' index keys: ``index_keys [L_msa, num_device + num_host, B, d]``, or with an fp8 k-index raw pages
  ``[L_msa, num_device + num_host, B x d + 4 B]`` uint8 holding the keys and their scales
  (``kv_cache.tensors.index_key_views``), so a migration's page copy moves both;
* dense layers' K/V: ``dense_kv [L_dense, 2, num_device + num_host, Hkv, B, D]``;
* host: ``host_sparse [L_msa, 2, num_host, Hkv, B, D]``, pinned (registered with CUDA, so kernels read
  it directly through unified addressing).

An MSA attention kernel must never see a host id: the MSA K/V tensors have only ``num_device`` pages.
The resolver (decode) and the prefill staging translate host ids first.
"""

import math
import weakref
from dataclasses import dataclass

import torch

from m3stack.engine.kv_cache.tensors import KVCacheSpec, LayerKVCache, allocate_index_pages, index_key_views

# Device blocks below this leave too little room to run (a step's new blocks, hot buffers, shared prefixes).
MIN_DEVICE_BLOCKS = 4


@dataclass(frozen=True)
class TierSizes:
    num_device: int  # device pages, the null page included
    num_host: int

    @property
    def num_ids(self) -> int:
        return self.num_device + self.num_host


def _itemsize(spec: KVCacheSpec) -> int:
    return torch.empty((), dtype=spec.kv_storage_dtype).element_size()


def host_bytes_per_block(spec: KVCacheSpec) -> int:
    """Pinned host bytes of one host block: the K and V of every MSA layer."""
    kv = 2 * spec.num_kv_heads * spec.block_size * spec.head_dim
    return _itemsize(spec) * kv * sum(spec.sparse_layers)


def device_bytes_per_host_block(spec: KVCacheSpec) -> int:
    """Device bytes a host block keeps: MSA index keys (with their scales, fp8) and dense-layer K/V."""
    return sum(spec.index_page_bytes if sparse else spec.kv_page_bytes for sparse in spec.sparse_layers)


def tier_sizes(spec: KVCacheSpec, device_bytes: float, host_bytes: float) -> TierSizes:
    """Split a device KV budget between device blocks and the device part of ``host_bytes`` worth of host blocks."""
    if not any(spec.sparse_layers):
        raise ValueError("CPU KV offload moves MSA layers' K/V to the host; this model has no MSA layer")
    num_host = int(host_bytes // host_bytes_per_block(spec))
    if num_host < 1:
        raise ValueError(
            f"--kv-offload-gb {host_bytes / 2**30:.3g} holds no block ({host_bytes_per_block(spec)} bytes each)"
        )
    num_device = int((device_bytes - num_host * device_bytes_per_host_block(spec)) // spec.bytes_per_page)
    if num_device < MIN_DEVICE_BLOCKS:
        raise ValueError(
            f"{device_bytes / 2**30:.3g} GiB of device KV memory cannot hold the device part of {num_host} host "
            f"blocks ({num_host * device_bytes_per_host_block(spec) / 2**30:.3g} GiB) plus {MIN_DEVICE_BLOCKS} "
            "device blocks: lower --kv-offload-gb or give the KV cache more device memory"
        )
    return TierSizes(num_device, num_host)


@dataclass
class TieredKVCache:
    layers: list[LayerKVCache]  # what the attention backend reads, one per model layer
    device_sparse: torch.Tensor  # [L_msa, 2, num_device, Hkv, B, D]
    host_sparse: torch.Tensor  # [L_msa, 2, num_host, Hkv, B, D], pinned on cuda
    index_keys: torch.Tensor  # [L_msa, num_ids, B, d], or raw fp8 pages with scales [L_msa, num_ids, page bytes]
    dense_kv: torch.Tensor | None  # [L_dense, 2, num_ids, Hkv, B, D]
    sparse_layer_ids: tuple[int, ...]  # model layer of each MSA slot
    sizes: TierSizes

    def msa_slot(self, layer: int) -> int:
        """Position of model layer ``layer`` among the MSA layers."""
        return self.sparse_layer_ids.index(layer)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory the device reads and writes directly (CUDA-registered when ``device`` is cuda).

    Registration (``cudaHostRegister``) instead of ``pin_memory=True``: the caching host allocator rounds
    a request up to a power of two, which for a pool of tens of GiB pins up to twice the memory asked for.
    """
    tensor = torch.empty(shape, dtype=dtype)
    if device.type != "cuda" or tensor.numel() == 0:
        return tensor
    cudart = torch.cuda.cudart()
    pointer, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    status = cudart.cudaHostRegister(pointer, size, 0)  # default flags: mapped and portable under UVA
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 2**30:.2f} GiB failed with CUDA error {int(status)}")
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)
    return tensor


def allocate_tiered_kv_cache(spec: KVCacheSpec, sizes: TierSizes, device: torch.device) -> TieredKVCache:
    """Allocate every tier; contents start uninitialized (only written slots are read)."""
    sparse_ids = tuple(i for i, sparse in enumerate(spec.sparse_layers) if sparse)
    dense_ids = tuple(i for i, sparse in enumerate(spec.sparse_layers) if not sparse)
    page = (spec.num_kv_heads, spec.block_size, spec.head_dim)
    kv_dtype = spec.kv_storage_dtype
    device_sparse = torch.empty((len(sparse_ids), 2, sizes.num_device, *page), dtype=kv_dtype, device=device)
    host_sparse = pinned_empty((len(sparse_ids), 2, sizes.num_host, *page), kv_dtype, device)
    index_keys = allocate_index_pages(spec, (len(sparse_ids), sizes.num_ids), device)
    dense_kv = None
    if dense_ids:
        dense_kv = torch.empty((len(dense_ids), 2, sizes.num_ids, *page), dtype=kv_dtype, device=device)
    layers = []
    for layer, sparse in enumerate(spec.sparse_layers):
        if sparse:
            slot = sparse_ids.index(layer)
            keys, scales = index_key_views(index_keys[slot], spec.block_size, spec.index_head_dim)
            layers.append(LayerKVCache(device_sparse[slot, 0], device_sparse[slot, 1], keys, scales))
        else:
            assert dense_kv is not None
            slot = dense_ids.index(layer)
            layers.append(LayerKVCache(dense_kv[slot, 0], dense_kv[slot, 1], None))
    return TieredKVCache(layers, device_sparse, host_sparse, index_keys, dense_kv, sparse_ids, sizes)


def hot_blocks_default(num_index_heads: int, topk: int, local_blocks: int) -> int:
    """Hot-buffer pages per request: room for every block one decode token can rank (local blocks stay on
    the device), rounded up to a multiple of 8."""
    return 8 * math.ceil(num_index_heads * (topk - local_blocks) / 8)
