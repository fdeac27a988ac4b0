"""Every layer as dense attention: the MSA layers' sparse calls become causal attention over the whole context.

The ``--attention dense`` baseline: the same weights and the same backend kernels (FlashInfer paged
prefill/decode on a GPU), with MSA's indexer output ignored.  The KV cache for it has no index-key
tensors (``dense_kv_spec``), so the wrapped backend stores and reads K/V only.
"""

import dataclasses

import torch

from m3stack.engine.attention.backend import DelegatingBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec


def dense_kv_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The same cache with no MSA layers: no index keys are stored."""
    return dataclasses.replace(spec, sparse_layers=(False,) * spec.num_layers)


class DenseOnlyAttention(DelegatingBackend):
    """``AttentionBackend`` that runs ``inner.dense`` for every layer, MSA layers included."""

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        del index_q, index_k  # dense attention needs no block selection
        return self.inner.dense(layer, q, k, v)
