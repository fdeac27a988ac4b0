"""The runtime tests' engine core on the tiny model (requests and items come from ``tests/engine/conftest.py``)."""

import pytest


@pytest.fixture
def build_core(tiny_model_dir):
    """An ``EngineCore`` on the tiny model, its KV cache poisoned with NaN so reading an unwritten slot shows."""
    from m3stack.engine.assembly.build import build_engine_core
    from m3stack.engine.assembly.config import EngineConfig

    def build(**overrides):
        settings = {"model": str(tiny_model_dir), "num_kv_blocks": 256, "max_num_batched_tokens": 256, **overrides}
        core = build_engine_core(EngineConfig(**settings))
        for layer in core.runner.backend.kv_caches:
            for tensor in (layer.key, layer.value, layer.index_key):
                if tensor is not None:
                    tensor.fill_(float("nan"))
        return core

    return build
