"""Build the offload parts of an engine from its configuration (``--kv-offload-gb``): sizes, tensors, the tiered
manager and the device side.  ``core`` and ``parallel`` call these when offload is on."""

import logging
from dataclasses import dataclass

import torch

from m3stack.engine.kv_cache.tensors import KVCacheSpec
from m3stack.engine.model.config import TextConfig
from m3stack.engine.offload.device import DeviceOffload
from m3stack.engine.offload.layout import (
    TierSizes,
    allocate_tiered_kv_cache,
    host_bytes_per_block,
    hot_blocks_default,
    tier_sizes,
)
from m3stack.engine.offload.tiered_manager import TieredKVCacheManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadSettings:
    host_gb: float  # pinned host memory for offloaded blocks, GiB
    hot_blocks: int | None = None  # hot-buffer pages per request; None: enough for one decode token's selection
    exact_device_blocks: bool = False  # the device block count was given exactly (tests): do not split it


def offload_tier_sizes(settings: OffloadSettings, spec: KVCacheSpec, num_device_blocks: int) -> TierSizes:
    """How many device and host blocks the device budget of ``num_device_blocks`` full blocks buys."""
    host_bytes = settings.host_gb * 2**30
    if settings.exact_device_blocks:
        if not any(spec.sparse_layers):
            raise ValueError("CPU KV offload moves MSA layers' K/V to the host; this model has no MSA layer")
        return TierSizes(num_device_blocks, max(1, int(host_bytes // host_bytes_per_block(spec))))
    return tier_sizes(spec, num_device_blocks * spec.bytes_per_page, host_bytes)


def resolve_hot_blocks(settings: OffloadSettings, text: TextConfig) -> int:
    """Hot-buffer pages per request; at least what one decode token can rank, or a resolution could fail."""
    needed = text.index_num_heads * (text.index_topk_blocks - text.index_local_blocks)
    hot_blocks = settings.hot_blocks or hot_blocks_default(
        text.index_num_heads, text.index_topk_blocks, text.index_local_blocks
    )
    if hot_blocks < max(needed, 1):
        raise ValueError(
            f"--kv-offload-hot-blocks {hot_blocks} is below the {needed} blocks one decode token can select "
            f"({text.index_num_heads} index heads x {text.index_topk_blocks - text.index_local_blocks} ranked blocks)"
        )
    return hot_blocks


@dataclass
class OffloadParts:
    manager: TieredKVCacheManager
    device: DeviceOffload


def build_offload(
    settings: OffloadSettings,
    spec: KVCacheSpec,
    text: TextConfig,
    sizes: TierSizes,
    *,
    enable_prefix_caching: bool,
    max_num_seqs: int,
    device: torch.device,
) -> OffloadParts:
    cache = allocate_tiered_kv_cache(spec, sizes, device)
    manager = TieredKVCacheManager(
        sizes, spec.block_size, enable_prefix_caching, hot_blocks=resolve_hot_blocks(settings, text),
        keep_tail_blocks=max(1, text.index_local_blocks), max_requests=max_num_seqs,
    )  # fmt: skip
    offload = DeviceOffload(
        cache, manager, num_kv_heads=text.num_kv_heads, topk=text.index_topk_blocks, max_batch=max_num_seqs,
        max_requests=max_num_seqs, device=device,
    )  # fmt: skip
    logger.info(
        "CPU KV offload: %d device blocks, %d host blocks (%.2f GiB pinned), %d hot-buffer pages per request",
        sizes.num_device - 1, sizes.num_host, cache.host_sparse.numel() * cache.host_sparse.element_size() / 2**30,
        manager.hot_blocks,
    )  # fmt: skip
    return OffloadParts(manager, offload)
