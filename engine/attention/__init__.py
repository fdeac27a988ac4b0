"""Attention as the model sees it: a backend per device, planned each step from ``engine.kv_cache.metadata``.

The model computes q/k/v (and the MSA index q/k) and hands them to an ``AttentionBackend``; the
backend stores the new keys into the paged cache and returns the attention output.  Two backends:
``reference`` (plain PyTorch, any device: CPU serving, CI, the naive MSA baseline) and ``gpu``
(Triton MSA kernels + FlashInfer).
"""
