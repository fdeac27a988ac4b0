"""The engine warm-up (compiling kernels on synthetic requests before serving) on the tiny model: it runs every
part the engine's limits allow, and users meet an engine that cannot tell it ran."""

import logging

import pytest

from m3stack.engine.runtime.offline import generate
from m3stack.engine.runtime.warmup import SPLIT_CONTEXT_BLOCKS, warm_up
from tests.engine.conftest import make_request

# The tiny model's blocks are 16 tokens: 512 blocks hold the long-context part (160 blocks, twice) with room.
ROOMY = {"num_kv_blocks": 512, "max_model_len": 8192}


def _serve(core) -> dict:
    prompts = [list(range(3, 60)), [*range(3, 40), 7, 9, 11]]  # the second shares the first's blocks
    return generate(core, [make_request(p, max_tokens=6, request_id=f"user-{i}") for i, p in enumerate(prompts)],
                    stagger_steps=1)  # fmt: skip


def test_warmed_engine_serves_like_a_fresh_one(build_core):
    fresh, warmed = build_core(**ROOMY), build_core(**ROOMY)
    report = warm_up(warmed)
    assert report.split_keys and report.requests == 4
    assert report.prompt_tokens > 2 * SPLIT_CONTEXT_BLOCKS * warmed.info.block_size
    stats = warmed.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_preemptions, stats.num_steps) == (0, 0, 0, 0)
    assert stats.num_used_tokens == 0 and not warmed.has_work
    assert not warmed.scheduler.kv.pool.cached  # no warm-up block is left to be hit
    expected, got = _serve(fresh), _serve(warmed)
    assert {k: (g.token_ids, g.num_cached_tokens) for k, g in got.items()} == {
        k: (g.token_ids, g.num_cached_tokens) for k, g in expected.items()
    }
    assert warmed.stats().prefix_hit_tokens == fresh.stats().prefix_hit_tokens > 0


def test_a_short_context_skips_the_long_part_and_a_tiny_one_is_refused(build_core):
    report = warm_up(build_core(num_kv_blocks=64, max_model_len=512))
    assert not report.split_keys and report.requests == 2
    with pytest.raises(ValueError, match="no room for a warm-up"):
        warm_up(build_core(num_kv_blocks=64, max_model_len=5))


def test_a_busy_engine_is_not_warmed(build_core):
    core = build_core()
    core.add_request(make_request([1, 2, 3]))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(core)


def test_the_builder_warms_up_when_asked_and_by_default_only_on_gpus(build_core, caplog):
    with caplog.at_level(logging.INFO, logger="m3stack.engine.runtime.warmup"):
        build_core(num_kv_blocks=64, max_model_len=512)  # cpu: off by default
        assert "warm-up:" not in caplog.text
        core = build_core(num_kv_blocks=64, max_model_len=512, warmup=True)
    assert "warm-up: 2 requests" in caplog.text
    assert core.stats().num_steps == 0 and not core.scheduler.kv.pool.cached
