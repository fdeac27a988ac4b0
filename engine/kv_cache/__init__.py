"""The paged KV cache: tensor layout (this package), block pool and prefix cache (engine.runtime)."""
