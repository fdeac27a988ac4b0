"""The paged KV cache and its bookkeeping: the tensors and their layout (``tensors``), where each token of a step
lives in them (``metadata``), the pool of pages (``block_pool``), per-request page tables (``manager``) and the
prefix-cache keys (``prefix_cache``).  What they read of a request is ``interfaces.KVRequest``."""
