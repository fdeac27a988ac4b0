"""Four ranks against one (gloo, four real processes, float32 on CPU) on a tiny model whose heads and experts
split four ways (8 query, 4 KV and 4 index heads, 4 experts): each rank holds one KV head, its index head and
MSA selection, a quarter of every expert (or one whole expert), and a quarter of the vocabulary.  Greedy tokens
equal and top-5 logprobs within 1e-4, prompts longer than the MSA selection window.
"""

import random

import pytest
import torch

from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.distributed.engine import stop_parallel_engine
from m3stack.engine.model.tiny import write_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.builder import build_engine_core
from m3stack.engine.runtime.config import EngineConfig
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

NEW_TOKENS = 10
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 4, "index_n_heads": 4}


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-4-kv-heads"), text_overrides=WIDE)


def _generate(core) -> dict[str, tuple[list[int], list[tuple[list[int], list[float]]]]]:
    rng = random.Random(4)
    prompts = {"long": [rng.randrange(380) for _ in range(150)], "short": [rng.randrange(380) for _ in range(40)]}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, top_logprobs=5)
    requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
    return {rid: (result.token_ids, result.top_logprobs) for rid, result in offline.generate(core, requests).items()}


def _config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=48, max_num_batched_tokens=64, cpu_threads=1, **overrides)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel-experts", "expert-parallel"])
def test_four_ranks_equal_one_rank(wide_model_dir, expert_parallel: bool) -> None:
    expected = _generate(build_engine_core(_config(wide_model_dir)))
    core = build_engine_core(
        _config(wide_model_dir, parallel=ParallelConfig(tensor_parallel=4, expert_parallel=expert_parallel))
    )
    try:
        got = _generate(core)
    finally:
        stop_parallel_engine(core)
    for rid, (tokens, tops) in expected.items():
        assert got[rid][0] == tokens, rid
        for (ids, logprobs), (other_ids, other_logprobs) in zip(tops, got[rid][1], strict=True):
            assert other_ids == ids
            torch.testing.assert_close(torch.tensor(other_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
