"""The engine on the tiny model: greedy tokens equal transformers', and do not depend on how the work was cut.

Chunked vs whole prefill, prefix hit vs miss, alone vs in a batch, preempted vs not: every way of
scheduling the same request must give the same greedy tokens.  Prompts are longer than the tiny
model's MSA selection window (4 blocks of 16 tokens), so sparse selection is really exercised.
"""

import random

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import Modality, SamplingParams
from m3stack.engine.runtime.validation import MultimodalSpec, build_request

NEW_TOKENS = 10


def _prompt(seed: int, length: int, vocab: int = 380) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]  # below the tiny tokenizer's special ids


def generate(
    core,
    prompts: dict[str, list[int]],
    *,
    stagger: int = 0,
    max_new_tokens: int = NEW_TOKENS,
    mm: dict[str, list[MultimodalSpec]] | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
) -> dict[str, list[int]]:
    """Greedy tokens per request id; with ``stagger`` > 0 request i arrives i * stagger steps late."""
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, stop_token_ids=stop_token_ids
    )
    requests = [
        build_request(core.info, rid, prompt, sampling, mm_items=(mm or {}).get(rid, ()))
        for rid, prompt in prompts.items()
    ]
    results = offline.generate(core, requests, stagger_steps=stagger, check_invariants=True)
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_usable_blocks
    return {rid: result.token_ids for rid, result in results.items()}


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf_model, prompt: list[int], **vision) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            **vision,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_match_transformers(build_core, hf_model):
    prompt = _prompt(1, 83)
    core = build_core(max_num_batched_tokens=32)  # chunked, through paged MSA
    assert generate(core, {"a": prompt})["a"] == _hf_greedy(hf_model, prompt)


def test_image_prompt_matches_transformers_when_chunked(build_core, hf_model, tiny_model_dir):
    info = build_core().info
    grid = (1, 4, 6)  # 24 patches -> 6 embeddings
    pixels = torch.randn(24, info.patch_dim, generator=torch.Generator().manual_seed(5))
    prefix, suffix = _prompt(2, 20), _prompt(3, 40)
    prompt = [*prefix, *[info.image_token_id] * 6, *suffix]
    spec = MultimodalSpec(Modality.IMAGE, "img-1", pixels, (grid,), ((20, 6),))
    expected = _hf_greedy(hf_model, prompt, pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    for budget in (8, 23, 512):  # chunks that cut through the image's embeddings, and a whole prefill
        core = build_core(max_num_batched_tokens=budget)
        assert generate(core, {"img": prompt}, mm={"img": [spec]})["img"] == expected, budget


def test_chunked_and_whole_prefill_give_the_same_tokens(build_core):
    prompts = {f"r{i}": _prompt(10 + i, n) for i, n in enumerate((70, 131, 45))}
    whole = generate(build_core(max_num_batched_tokens=1024), prompts)
    for budget in (7, 16, 50):
        assert generate(build_core(max_num_batched_tokens=budget), prompts) == whole, budget


def test_a_prefix_hit_gives_the_same_tokens_as_a_miss(build_core):
    shared = _prompt(20, 80)
    later = [*shared, *_prompt(21, 19)]
    miss = generate(build_core(), {"later": later})["later"]
    core = build_core()
    generate(core, {"first": [*shared, 7, 8, 9]})
    hit = generate(core, {"later": later})["later"]
    assert core.scheduler.kv.prefix_hit_tokens == 80  # five full 16-token blocks came from the cache
    assert hit == miss


def test_batch_composition_does_not_change_tokens(build_core):
    prompts = {f"r{i}": _prompt(30 + i, 20 + 17 * i) for i in range(5)}
    alone = {rid: generate(build_core(), {rid: p})[rid] for rid, p in prompts.items()}
    assert generate(build_core(max_num_batched_tokens=40), prompts) == alone
    assert generate(build_core(max_num_batched_tokens=40), prompts, stagger=3) == alone


def test_preemption_by_recompute_gives_the_same_tokens(build_core):
    prompts = {f"r{i}": _prompt(40 + i, 40) for i in range(4)}
    roomy = generate(build_core(), prompts, max_new_tokens=30)
    tight = build_core(num_kv_blocks=14, max_model_len=80, max_num_batched_tokens=64)
    assert generate(tight, prompts, max_new_tokens=30) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_async_scheduling_gives_the_same_tokens(build_core):
    """One step in flight: inputs take the previous step's tokens on the device, stops are seen a step late."""
    prompts = {f"r{i}": _prompt(70 + i, 15 + 23 * i) for i in range(4)}
    sync = generate(build_core(max_num_batched_tokens=40), prompts, stagger=2, max_new_tokens=16)
    assert generate(build_core(max_num_batched_tokens=40, async_scheduling=True), prompts, stagger=2,
                    max_new_tokens=16) == sync  # fmt: skip
    stop = sync["r1"][5]  # a token the model really produces: requests that meet it stop there
    with_stop = generate(build_core(), prompts, max_new_tokens=16, stop_token_ids=frozenset({stop}))
    assert with_stop["r1"] == sync["r1"][: sync["r1"].index(stop)]
    assert generate(build_core(async_scheduling=True), prompts, max_new_tokens=16,
                    stop_token_ids=frozenset({stop})) == with_stop  # fmt: skip
    tight = build_core(num_kv_blocks=10, max_model_len=112, max_num_batched_tokens=64, async_scheduling=True)
    assert generate(tight, prompts, max_new_tokens=16) == generate(build_core(), prompts, max_new_tokens=16)
    assert tight.scheduler.num_preemptions > 0
