"""Attention as the model sees it: per-step metadata plus a backend per device.

The model computes q/k/v (and the MSA index q/k) and hands them to an ``AttentionBackend``; the
backend stores the new keys into the paged cache and returns the attention output.  Two backends:
``reference`` (plain PyTorch, any device: CPU serving, CI, the naive MSA baseline) and ``gpu``
(Triton MSA kernels + FlashInfer).
"""
