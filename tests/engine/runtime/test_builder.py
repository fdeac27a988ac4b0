"""Engine assembly: context limit and KV capacity checks, device and dtype resolution."""

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.choices import resolve_device, resolve_dtype
from m3stack.engine.assembly.config import EngineConfig


def test_the_context_limit_defaults_to_the_kv_capacity_when_that_is_smaller(tiny_model_dir):
    core = build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=40))
    assert core.info.max_model_len == 40 * 16
    assert core.scheduler.kv.pool.num_usable_blocks == 40 and core.info.num_kv_blocks == 40


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_model_len": 100_000}, "exceeds the model's max_position_embeddings 65536"),
        ({"max_model_len": 1000, "num_kv_blocks": 10}, "exceeds the KV cache capacity of 160 tokens"),
        ({"kv_cache_gb": 1e-9}, "no room for a KV cache"),
        ({"model": "/nonexistent"}, "is not a folder"),
    ],
)
def test_impossible_settings_are_refused_with_the_reason(tiny_model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        build_engine_core(EngineConfig(**{"model": str(tiny_model_dir), **settings}))


def test_device_and_dtype_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
