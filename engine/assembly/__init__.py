"""The engine's composition root: an ``EngineConfig`` in, a running ``EngineCore`` out, on one rank or many.

``build.build_engine_core`` is the one entry (the server's, the tests', the benchmarks'): it loads the model, and
``core.assemble_engine_core`` sizes and allocates the KV cache, picks the attention backend (``choices``) and
builds the scheduler, runner and core of ``engine.runtime`` around them (with CPU KV offload, ``offload`` builds
the tiered manager and the device side of ``engine.offload``); a parallel engine's ranks are built by
``parallel``, over the processes, sharded model and step messages of ``engine.distributed``.  ``runtime`` and
``distributed`` provide parts and import neither each other nor this package.  ``config`` (``EngineConfig``) is
torch-free: the CLI checks flags before torch loads.
"""
