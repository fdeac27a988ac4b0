"""Four and eight ranks against one (gloo, real processes, float32 on CPU) on a tiny model whose heads and experts
split eight ways (16 query, 8 KV and 8 index heads, 8 experts): at 8 ranks each holds one KV head, its index head
and MSA selection, an eighth of every expert (or one whole expert) and of the vocabulary.  Greedy tokens equal and
top-5 logprobs within 1e-4, prompts longer than the MSA selection window.
"""

import random

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import stop_parallel_engine
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.model.tiny import write_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

NEW_TOKENS = 10
WIDE = {"num_attention_heads": 16, "num_key_value_heads": 8, "index_n_heads": 8, "num_local_experts": 8}


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-8-kv-heads"), text_overrides=WIDE)


def _generate(core) -> dict[str, tuple[list[int], list[tuple[list[int], list[float]]]]]:
    rng = random.Random(4)
    prompts = {"long": [rng.randrange(380) for _ in range(150)], "short": [rng.randrange(380) for _ in range(40)]}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, top_logprobs=5)
    requests = [build_request(core.info, rid, prompt, sampling) for rid, prompt in prompts.items()]
    return {rid: (result.token_ids, result.top_logprobs) for rid, result in offline.generate(core, requests).items()}


def _config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=48, max_num_batched_tokens=64, cpu_threads=1, **overrides)


@pytest.fixture(scope="module")
def one_rank(wide_model_dir):
    return _generate(build_engine_core(_config(wide_model_dir)))


@pytest.mark.parametrize(
    ("ranks", "expert_parallel"), [(4, False), (4, True), (8, False), (8, True)],
    ids=["4-tensor-parallel-experts", "4-expert-parallel", "8-tensor-parallel-experts", "8-expert-parallel"],
)  # fmt: skip
def test_ranks_equal_one_rank(wide_model_dir, one_rank, ranks: int, expert_parallel: bool) -> None:
    expected = one_rank
    core = build_engine_core(
        _config(wide_model_dir, parallel=ParallelConfig(tensor_parallel=ranks, expert_parallel=expert_parallel))
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
