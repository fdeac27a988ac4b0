"""MSA (MiniMax Sparse Attention): reference semantics and kernels (Triton, FlashInfer)."""
