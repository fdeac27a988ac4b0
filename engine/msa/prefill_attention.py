"""MSA sparse prefill attention over the paged KV cache: the entry point.

Query head ``i`` of token ``t`` (KV group ``h = i // G``) attends the keys ``j <= positions[t]`` of
the blocks in ``selection[h, t]``, softmax scale ``scale``.  ``selection`` is ``[Hkv, T, K]`` int32
or int64 logical block ids of the token's request (``prefill_index_topk``'s output; the kernels
translate them through ``metadata.page_table``).  Order within a row does not matter; ``-1`` and
blocks after the token's own block are ignored (causality would mask them anyway); a row must not
repeat a block.  A token with no valid block gets zeros.

Methods: ``"block_major"`` (``prefill_block_major``, the fast path) and ``"query_major"``
(``prefill_query_major``, the side-by-side peer and fallback).

Peak extra memory of ``block_major``: ``min(T, chunk) * Hq * K * (D * itemsize + 4)`` bytes of
partials, where ``chunk`` is the most tokens whose partials fit ``workspace_bytes`` (2 GiB by
default: 8065 tokens for M3 in bf16), plus ``8 * Hkv * T * K`` bytes for the query lists and a few
int32 arrays per (chunk, KV head, block) of the batch.  ``query_major`` needs none.
"""

from typing import Literal

import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.kv_cache.tensors import FP8_KV_DTYPE
from m3stack.engine.msa.launch import use_triton
from m3stack.engine.msa.prefill_block_major import block_major_attention
from m3stack.engine.msa.prefill_common import PrefillTuning
from m3stack.engine.msa.prefill_plan import check_paged_layout
from m3stack.engine.msa.prefill_query_major import query_major_attention

DEFAULT_WORKSPACE_BYTES = 2 << 30
METHODS = ("block_major", "query_major")


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selection: torch.Tensor,
    metadata: AttentionMetadata,
    method: str,
) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown sparse prefill method {method!r}; use one of {METHODS}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value caches must both be [num_pages, Hkv, block_size, D], got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q has head dim {head_dim} but the KV cache has {cache_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_paged_layout(block_size, num_tokens, metadata, "the KV cache")
    if selection.dim() != 3 or selection.shape[:2] != (num_kv_heads, num_tokens):
        raise ValueError(f"selection must be [Hkv={num_kv_heads}, T={num_tokens}, K], got {tuple(selection.shape)}")
    if selection.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"selection must hold int32 or int64 block ids, got {selection.dtype}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"q ({q.dtype}) and the K/V caches ({key_cache.dtype}, {value_cache.dtype}) must share a dtype"
        )
    if len({q.device, key_cache.device, value_cache.device, selection.device, metadata.positions.device}) != 1:
        raise ValueError("q, the K/V caches, selection and metadata must be on one device")
    if not use_triton(q):
        raise ValueError("sparse_prefill runs Triton kernels: it needs CUDA tensors (or TRITON_INTERPRET=1)")
    for name, tensor in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache), ("selection", selection)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")


def sparse_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selection: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    method: Literal["block_major", "query_major"] = "block_major",
    *,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    tuning: PrefillTuning | None = None,
) -> torch.Tensor:
    """MSA attention of every new token of a step over its selected blocks: ``[T, Hq, D]`` in q's dtype.

    ``q`` ``[T, Hq, D]`` after norm and RoPE; ``key_cache``/``value_cache`` HND
    ``[num_pages, Hkv, block_size, D]`` already holding the new tokens' keys; ``selection`` and the
    workspace as in the module docstring.
    """
    _check_inputs(q, key_cache, value_cache, selection, metadata, method)
    tuning = tuning or PrefillTuning()
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if method == "block_major":
        block_major_attention(q, key_cache, value_cache, selection, metadata, scale, out, workspace_bytes, tuning)
    else:
        query_major_attention(
            q, key_cache, value_cache, selection, metadata, scale, out, tuning.query_major_num_warps, tuning.num_stages
        )
    return out
