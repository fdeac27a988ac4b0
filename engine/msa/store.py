"""Write a step's new keys into the paged cache: K and V ``[num_pages, Hkv, B, D]`` (HND) and, on MSA
layers, the index keys ``[num_pages, B, d]`` (``engine.kv_cache.tensors``).

Token ``t`` goes to slot ``slot_mapping[t] = page * B + offset``; a negative slot (a padded token
of a CUDA-graph batch) writes nothing.  One Triton program per token moves its ``Hkv x D`` K and V
rows and its index key; the torch fallback does the same with indexed assignment.
"""

import torch
import triton
import triton.language as tl

from m3stack.engine.kv_cache.tensors import (
    FP8_E4M3_MAX,
    LayerKVCache,
    check_index_scale,
    quantize_index_keys,
    to_kv_cache,
)
from m3stack.engine.msa.launch import use_triton

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def store_token(
    token, slot_ptr,
    k_ptr, v_ptr, ik_ptr,
    key_cache_ptr, value_cache_ptr, index_cache_ptr, index_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt,
    stride_cp, stride_ch, stride_cb, stride_ip, stride_ib, stride_sp,
    HKV: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    DI: tl.constexpr, DI_P: tl.constexpr, B: tl.constexpr, HAS_INDEX: tl.constexpr, INDEX_SCALED: tl.constexpr,
):  # fmt: skip
    """Write token ``token``'s K and V rows (and index key) at its slot; also called by kernels that
    store as a side task (the fused decode indexer, ``msa.decode_index``).  ``INDEX_SCALED``: the k-index is fp8
    with a float32 scale per token (``kv_cache.tensors``), ``max |key| / 448``, and holds ``key / scale``."""
    token = token.to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        page = slot // B
        offset = slot % B
        heads = tl.arange(0, HKV_P)[:, None]
        dims = tl.arange(0, D_P)[None, :]
        mask = (heads < HKV) & (dims < D)
        dst = page * stride_cp + heads * stride_ch + offset * stride_cb + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if key_cache_ptr.dtype.element_ty == tl.float8e4nv:  # an fp8 KV cache: clamped to e4m3's range
            k = tl.minimum(tl.maximum(k.to(tl.float32), -_FP8_MAX), _FP8_MAX)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -_FP8_MAX), _FP8_MAX)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
        if HAS_INDEX:
            idims = tl.arange(0, DI_P)
            imask = idims < DI
            ik = tl.load(ik_ptr + token * stride_ikt + idims, mask=imask)
            if INDEX_SCALED:
                amax = tl.max(tl.abs(ik.to(tl.float32)), axis=0)
                scale = tl.where(amax > 0, amax / _FP8_MAX, 1.0)
                ik = ik.to(tl.float32) / scale
                tl.store(index_scale_ptr + page * stride_sp + offset, scale)
            tl.store(
                index_cache_ptr + page * stride_ip + offset * stride_ib + idims,
                ik.to(index_cache_ptr.dtype.element_ty),
                mask=imask,
            )


@triton.jit
def _store_kernel(
    slot_ptr,
    k_ptr, v_ptr, ik_ptr,
    key_cache_ptr, value_cache_ptr, index_cache_ptr, index_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt,
    stride_cp, stride_ch, stride_cb, stride_ip, stride_ib, stride_sp,
    HKV: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    DI: tl.constexpr, DI_P: tl.constexpr, B: tl.constexpr, HAS_INDEX: tl.constexpr, INDEX_SCALED: tl.constexpr,
):  # fmt: skip
    store_token(
        tl.program_id(0), slot_ptr, k_ptr, v_ptr, ik_ptr, key_cache_ptr, value_cache_ptr, index_cache_ptr,
        index_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_ikt, stride_cp, stride_ch, stride_cb,
        stride_ip, stride_ib, stride_sp, HKV, HKV_P, D, D_P, DI, DI_P, B, HAS_INDEX, INDEX_SCALED,
    )  # fmt: skip


def check_store_inputs(cache: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       index_k: torch.Tensor | None) -> None:  # fmt: skip
    """What ``store_kv`` checks (also for kernels that store as a side task)."""
    num_pages, num_kv_heads, block_size, head_dim = cache.key.shape
    num_tokens = slot_mapping.shape[0]
    if cache.value.shape != cache.key.shape:
        raise ValueError(f"key cache {tuple(cache.key.shape)} and value cache {tuple(cache.value.shape)} differ")
    for name, x in (("k", k), ("v", v)):
        if x.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected ({num_tokens}, {num_kv_heads}, {head_dim})")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if (index_k is None) != (cache.index_key is None):
        raise ValueError("index_k must be given exactly when the layer has an index-key cache")
    if index_k is not None:
        index_dim = cache.index_key.shape[2]
        if index_k.shape != (num_tokens, index_dim) or index_k.stride(-1) != 1:
            raise ValueError(
                f"index_k has shape {tuple(index_k.shape)}, expected ({num_tokens}, {index_dim}) contiguous"
            )
        # With CPU offload the index keys also cover host blocks (engine.offload.layout): more pages, never fewer.
        if cache.index_key.shape[0] < num_pages or cache.index_key.shape[1] != block_size:
            raise ValueError(f"index-key cache {tuple(cache.index_key.shape)} does not cover the KV pages")
        check_index_scale(cache.index_key, cache.index_key_scale)
    if cache.value.stride() != cache.key.stride():
        raise ValueError("key and value caches must share strides")
    if cache.key.stride(-1) != 1 or (cache.index_key is not None and cache.index_key.stride(-1) != 1):
        raise ValueError("cache tensors need a contiguous last dimension")


def store_kv(
    cache: LayerKVCache,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_k: torch.Tensor | None = None,
    *,
    torch_only: bool = False,
) -> None:
    """Write K, V ``[T, Hkv, D]`` (and ``index_k`` ``[T, d]`` on MSA layers) at ``slot_mapping`` ``[T]``.

    Slots must be unique among non-negative entries and below ``num_pages * B`` (the scheduler's
    block allocation guarantees it; it is not checked here because that would need a device sync).
    ``torch_only`` writes with indexed assignment even where the kernel could run (the plain-PyTorch
    reference backend, which must not slow down 10x when ``TRITON_INTERPRET=1`` is set process-wide).
    """
    check_store_inputs(cache, slot_mapping, k, v, index_k)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if use_triton(k) and not torch_only:
        _store_triton(cache, slot_mapping, k, v, index_k)
        return
    block_size = cache.key.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, offsets = slots // block_size, slots % block_size
    cache.key[pages, :, offsets] = to_kv_cache(k[keep], cache.key.dtype)
    cache.value[pages, :, offsets] = to_kv_cache(v[keep], cache.value.dtype)
    if index_k is not None and cache.index_key_scale is not None:
        cache.index_key[pages, offsets], cache.index_key_scale[pages, offsets] = quantize_index_keys(index_k[keep])
    elif index_k is not None:
        cache.index_key[pages, offsets] = index_k[keep].to(cache.index_key.dtype)


def store_launch_args(cache: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      index_k: torch.Tensor | None) -> tuple[tuple, dict[str, int | bool]]:  # fmt: skip
    """``store_token``'s runtime arguments after ``token`` (slots, sources, caches, strides) and its
    constexprs, for ``_store_kernel`` and for kernels that store as a side task."""
    _, num_kv_heads, block_size, head_dim = cache.key.shape
    has_index = index_k is not None
    index_cache = cache.index_key if has_index else cache.key
    index_src = index_k if has_index else k
    index_dim = index_cache.shape[-1] if has_index else 1
    scaled = has_index and cache.index_key_scale is not None
    index_scale = cache.index_key_scale if scaled else index_cache  # a stand-in the kernel never reads
    args = (
        slot_mapping, k, v, index_src, cache.key, cache.value, index_cache, index_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), index_src.stride(0),
        cache.key.stride(0), cache.key.stride(1), cache.key.stride(2), index_cache.stride(0), index_cache.stride(1),
        index_scale.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HKV=num_kv_heads, HKV_P=triton.next_power_of_2(num_kv_heads), D=head_dim,
        D_P=triton.next_power_of_2(head_dim), DI=index_dim, DI_P=triton.next_power_of_2(index_dim),
        B=block_size, HAS_INDEX=has_index, INDEX_SCALED=scaled,
    )  # fmt: skip
    return args, constexprs


def _store_triton(cache: LayerKVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  index_k: torch.Tensor | None) -> None:  # fmt: skip
    args, constexprs = store_launch_args(cache, slot_mapping, k, v, index_k)
    _store_kernel[(slot_mapping.shape[0],)](*args, **constexprs, num_warps=4)
