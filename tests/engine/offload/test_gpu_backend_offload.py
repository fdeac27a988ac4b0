"""The GPU attention backend (Triton paths, interpreted on CPU) with CPU KV offload equals the same backend
without it, step by step: a prefill, a prefill chunk over blocks that moved to the host (working set), and
decode steps that read them through the hot buffer (Triton resolver and copy kernel).

The page tables come from the real tiered manager under pressure, and the blocks reach the host through the
real spill copies; every tensor starts as NaN, so a page read before it was written (or a host block read
unresolved) shows up in the output.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from dataclasses import replace

import pytest
import torch

from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.offload.device import DeviceOffload
from m3stack.engine.offload.layout import TierSizes, allocate_tiered_kv_cache
from m3stack.engine.offload.tiered_manager import TieredKVCacheManager
from m3stack.engine.runtime.request import Request, SamplingParams
from tests.engine.attention.step_support import step_metadata

BLOCK, HQ, HKV, HEAD_DIM, INDEX_DIM, TOPK, LOCAL = 16, 4, 2, 32, 16, 3, 1
HOT = HKV * (TOPK - LOCAL)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK, index_head_dim=INDEX_DIM,
                   sparse_layers=(False, True), dtype=torch.float32)  # fmt: skip
SIZES = TierSizes(num_device=9, num_host=16)  # 8 usable device blocks: the request's 9 do not fit
# New tokens per step: a prefill, a chunk after the spill (over Hkv x 32 columns: the prefill path with or
# without offload, so both run the same kernels), two decode steps.
STEPS = [96, 40, 1, 1]


def _poison(tensors) -> None:
    for tensor in tensors:
        if tensor is not None:
            tensor.fill_(float("nan"))


@pytest.mark.parametrize("index_dtype", [None, torch.float8_e4m3fn], ids=["index-as-cache", "fp8-index"])
def test_offloaded_steps_equal_the_plain_backend(index_dtype: torch.dtype | None):
    """With an fp8 k-index the raw index pages (keys and their scales) are what a spill moves between ids."""
    spec = replace(SPEC, index_dtype=index_dtype)
    generator = torch.Generator().manual_seed(3)
    tiered = allocate_tiered_kv_cache(spec, SIZES, torch.device("cpu"))
    index_views = (tiered.layers[1].index_key, tiered.layers[1].index_key_scale)
    _poison([tiered.device_sparse, tiered.host_sparse, *index_views, tiered.dense_kv])
    manager = TieredKVCacheManager(SIZES, BLOCK, False, hot_blocks=HOT, keep_tail_blocks=LOCAL, max_requests=2)
    offload = DeviceOffload(tiered, manager, num_kv_heads=HKV, topk=TOPK, max_batch=2, max_requests=2,
                            device=torch.device("cpu"))  # fmt: skip
    offloaded = GpuAttentionBackend(tiered.layers, topk_blocks=TOPK, local_blocks=LOCAL, num_q_heads=HQ,
                                    offload=offload)  # fmt: skip
    plain_caches = allocate_kv_cache(spec, 16, "cpu")
    _poison(t for layer in plain_caches for t in (layer.key, layer.value, layer.index_key, layer.index_key_scale))
    plain = GpuAttentionBackend(plain_caches, topk_blocks=TOPK, local_blocks=LOCAL, num_q_heads=HQ)
    plain_pages = torch.arange(1, 16).view(1, 15)

    request = Request("r", list(range(sum(STEPS))), SamplingParams(temperature=0.0), max_tokens=1)
    done = 0
    for new in STEPS:
        assert manager.allocate(request, new)
        table = torch.zeros((1, 15), dtype=torch.int64)
        ids = manager.block_ids("r")
        table[0, : len(ids)] = torch.from_numpy(ids.astype("int64"))
        offload.before_step(["r"], torch.tensor([new]).numpy())
        q = torch.randn(new, HQ, HEAD_DIM, generator=generator)
        k = torch.randn(new, HKV, HEAD_DIM, generator=generator)
        v = torch.randn(new, HKV, HEAD_DIM, generator=generator)
        index_q = torch.randn(new, HKV, INDEX_DIM, generator=generator).round()
        index_k = torch.randn(new, INDEX_DIM, generator=generator).round()
        outputs = []
        for backend, pages in ((offloaded, table), (plain, plain_pages)):
            backend.begin_step(step_metadata({0: new}, {0: done}, pages, BLOCK))
            outputs.append((backend.dense(0, q, k, v), backend.sparse(1, q, k, v, index_q, index_k)))
        (dense_off, sparse_off), (dense_plain, sparse_plain) = outputs
        assert not sparse_off.isnan().any()
        torch.testing.assert_close(dense_off, dense_plain, rtol=0, atol=0)
        torch.testing.assert_close(sparse_off, sparse_plain, rtol=0, atol=0)
        done += new
        request.num_computed_tokens = done
        manager.publish_computed_blocks(request, done)
    stats = offload.stats()
    assert stats.spilled_blocks == 5 and stats.staged_bytes > 0  # the second chunk read host blocks
    assert stats.hot_hits + stats.hot_misses > 0  # the decode steps selected host blocks
    manager.check_invariants()
