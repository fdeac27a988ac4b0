"""``--attention``: one switch picks the backend; ``dense`` really runs MSA layers as full attention.

On the tiny model (MSA blocks of 16 tokens, top-4) a context of at most 64 tokens selects every block,
so MSA equals dense attention there, and only there.
"""

import json
import random

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.choices import make_attention_backend
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.attention.dense_only import DenseOnlyAttention
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.model.config import parse_config
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

NEW_TOKENS = 8


def _greedy(model_dir, attention: str, prompt: list[int]) -> list[int]:
    core = build_engine_core(EngineConfig(model=str(model_dir), num_kv_blocks=32, attention=attention))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    request = build_request(core.info, "r", prompt, sampling)
    return offline.generate(core, [request])["r"].token_ids


def test_dense_equals_msa_within_the_selection_window_and_not_beyond(tiny_model_dir):
    rng = random.Random(3)
    short = [rng.randrange(380) for _ in range(64 - NEW_TOKENS)]
    assert _greedy(tiny_model_dir, "dense", short) == _greedy(tiny_model_dir, "naive", short)
    long = [rng.randrange(380) for _ in range(300)]
    assert _greedy(tiny_model_dir, "dense", long) != _greedy(tiny_model_dir, "naive", long)


def test_dense_mode_keeps_no_index_keys(tiny_model_dir):
    core = build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, attention="dense"))
    backend = core.runner.backend
    assert isinstance(backend, DenseOnlyAttention) and isinstance(backend.inner, ReferenceAttentionBackend)
    assert all(layer.index_key is None for layer in backend.inner.kv_caches)


def test_modes_that_cannot_run_are_refused(tiny_model_dir, monkeypatch):
    m3 = parse_config(json.loads((tiny_model_dir / "config.json").read_text()))
    with pytest.raises(ValueError, match="unknown attention mode"):
        make_attention_backend([], m3, torch.device("cpu"), mode="fast")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs --device cuda"):
        make_attention_backend([], m3, torch.device("cpu"), mode="msa")


def test_the_shared_page_scan_setting_reaches_the_decode_indexer(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for shared in (False, True):
        config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, attention="msa", msa_shared_page_scan=shared)
        tuning = build_engine_core(config).runner.backend.decode_tuning
        assert tuning.scan.shared_pages == shared
        assert tuning.planned_programs_per_sm == tuning.scan_programs_per_sm * (4 if shared else 1)
