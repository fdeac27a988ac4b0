"""Two ranks against one on the tiny model, float32 on CPU, gloo between two real processes.

The 2-rank engine is the real thing end to end: ``build_engine_core`` with ``--tensor-parallel 2`` spawns the
second rank, each rank loads its slices of the checkpoint, rank 0's scheduler and runner drive both through the
step broadcast.  Against the 1-rank engine, for a text and an image prompt longer than the MSA selection window
(prefill chunked through the image's embeddings): identical greedy tokens and top-5 logprobs within 1e-4; and
every prompt position's logits within 1e-4 relative error, through a paged runner on the same two processes.
Both MoE layouts: experts sliced across ranks, and whole experts per rank (``--expert-parallel``).
"""

import random

import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import stop_parallel_engine
from m3stack.engine.attention.reference import ReferenceAttentionBackend
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.distributed.recording import RecordingBackend
from m3stack.engine.model.vision import Modality as ModelModality
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.request import Modality, SamplingParams
from m3stack.engine.runtime.validation import MultimodalSpec, build_request
from tests.engine.model.hf_oracle import relative_error
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

NEW_TOKENS = 12
TOP_LOGPROBS = 5
NUM_KV_BLOCKS = 64
PROMPT_PAGES = 32
GRID = (1, 8, 12)  # 96 patches -> 24 image embeddings


def _settings(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=64,
                        cpu_threads=1, **overrides)  # fmt: skip


def _prompts(info) -> dict[str, tuple[list[int], list[MultimodalSpec]]]:
    rng = random.Random(7)
    text = [rng.randrange(380) for _ in range(150)]
    pixels = torch.randn(96, info.patch_dim, generator=torch.Generator().manual_seed(7))
    before, after = [rng.randrange(380) for _ in range(50)], [rng.randrange(380) for _ in range(60)]
    image_prompt = [*before, *[info.image_token_id] * 24, *after]
    image = MultimodalSpec(Modality.IMAGE, "image-7", pixels, (GRID,), ((50, 24),))
    return {"text": (text, []), "image": (image_prompt, [image])}


def _generate(core: EngineCore) -> dict[str, tuple[list[int], list[float], list[tuple[list[int], list[float]]]]]:
    """Greedy tokens, their logprobs and the top-5 (ids, logprobs) of every step, per prompt."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True,
                              top_logprobs=TOP_LOGPROBS)  # fmt: skip
    results: dict = {}
    for name, (prompt, media) in _prompts(core.info).items():
        core.add_request(build_request(core.info, name, prompt, sampling, mm_items=media))
        results[name] = ([], [], [])
    while core.has_work:
        for output in core.step().outputs:
            if output.error is not None:
                raise output.error
            tokens, logprobs, tops = results[output.request_id]
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
            tops += output.new_top_logprobs
    return results


def _prompt_logits(core: EngineCore, backend_wrapper) -> dict[str, torch.Tensor]:
    """Logits of every prompt position, prefilled in one step through the engine's own model object."""
    model = core.runner.model
    text = model.config.text
    out = {}
    for name, (prompt, media) in _prompts(core.info).items():
        ids = torch.tensor(prompt)
        rows = embeds = None
        if media:
            with torch.inference_mode():
                embeds = model.encode_vision(media[0].pixel_values, torch.tensor([GRID]), ModelModality.IMAGE)
            rows = torch.nonzero(ids == core.info.image_token_id).flatten()

        def factory(caches):
            reference = ReferenceAttentionBackend(caches, topk_blocks=text.index_topk_blocks,
                                                  local_blocks=text.index_local_blocks)  # fmt: skip
            return backend_wrapper(reference)

        runner = PagedRunner(model, PROMPT_PAGES, "cpu", backend_factory=factory)
        with torch.inference_mode():
            out[name] = runner.prefill(Chunk(Sequence(), ids, rows, embeds))
    return out


@pytest.fixture(scope="module")
def single_rank(tiny_model_dir):
    core = build_engine_core(_settings(tiny_model_dir))
    return _generate(core), _prompt_logits(core, lambda backend: backend)


@pytest.fixture(scope="module", params=["tensor-parallel-experts", "expert-parallel"])
def two_ranks(request, tiny_model_dir):
    parallel = ParallelConfig(tensor_parallel=2, expert_parallel=request.param == "expert-parallel")
    core = build_engine_core(_settings(tiny_model_dir, parallel=parallel))
    try:
        yield _generate(core), _prompt_logits(core, RecordingBackend), core
    finally:
        stop_parallel_engine(core)


@pytest.mark.parametrize("name", ["text", "image"])
def test_two_ranks_give_the_same_greedy_tokens_and_logprobs(single_rank, two_ranks, name):
    (tokens, logprobs, tops), (tokens2, logprobs2, tops2) = single_rank[0][name], two_ranks[0][name]
    assert len(tokens) == NEW_TOKENS
    assert tokens2 == tokens
    assert torch.allclose(torch.tensor(logprobs2), torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert [ids for ids, _ in tops2] == [ids for ids, _ in tops]
    assert torch.allclose(torch.tensor([v for _, v in tops2]), torch.tensor([v for _, v in tops]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["text", "image"])
def test_two_ranks_give_the_same_prompt_logits(single_rank, two_ranks, name):
    single, double = single_rank[1][name], two_ranks[1][name]
    assert double.shape == single.shape == (len(_prompts(two_ranks[2].info)[name][0]), two_ranks[2].info.vocab_size)
    assert not double.isnan().any()
    assert relative_error(double, single) <= 1e-4


def test_the_second_rank_holds_half_the_heads_and_the_engine_says_so(two_ranks):
    core = two_ranks[2]
    model = core.runner.model.model
    text = model.config.text
    # Rank 0's own shard: half of the query and KV heads, half of the vocabulary rows, the whole index key.
    assert core.runner.backend.inner.kv_caches[0].key.shape[1] == text.num_kv_heads // 2
    assert model.layers[1].attn.num_heads == text.num_heads // 2
    assert model.lm_head.weight.shape[0] == -(-text.vocab_size // 2)
    assert core.runner.backend.inner.kv_caches[1].index_key.shape[2] == text.index_head_dim
