"""The interface between the model's attention layers and the attention implementations."""

from typing import Protocol

import torch

from m3stack.engine.kv_cache.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores new keys into the paged cache and attends over it, for one step at a time.

    Shapes (T new tokens): q ``[T, Hq, D]``; k, v ``[T, Hkv, D]`` after q/k norm and RoPE;
    index_q ``[T, Hidx, d]`` and index_k ``[T, d]`` after the indexer's norm and RoPE.  Outputs are
    ``[T, Hq, D]`` in q's dtype.  Softmax scale is ``D ** -0.5``.
    """

    def begin_step(self, metadata: AttentionMetadata) -> None:
        """Plan the step (host-side work such as FlashInfer ``plan()``); called before layer 0."""
        ...

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal GQA over all cached keys of each request (``full_attention`` layers)."""
        ...

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        """MSA (``minimax_m3_sparse`` layers): index scores, block top-k, block-sparse attention."""
        ...


class DelegatingBackend:
    """An ``AttentionBackend`` that hands every call to ``inner``: the base of backends that change one thing
    (``dense_only.DenseOnlyAttention``, the parallel engine's ``RecordingBackend``) and pass the rest through."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    @property
    def supports_cuda_graphs(self) -> bool:
        return bool(getattr(self.inner, "supports_cuda_graphs", False))

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.inner.begin_step(metadata)

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner.dense(layer, q, k, v)

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        return self.inner.sparse(layer, q, k, v, index_q, index_k)
