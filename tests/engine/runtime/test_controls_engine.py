"""Sampling controls through the whole engine on the tiny model: each changes tokens as documented.

Penalties and logit bias are checked against transformers' ``generate`` on the same weights, with its own
repetition penalty and, for OpenAI's presence/frequency penalties and logit bias, a logits processor that
spells out OpenAI's formula; grammars by parsing what random weights produce; prompt logprobs against a full
forward of the HF model.  Sync and async scheduling both (async defers a constrained step's sampling until the
previous step's tokens reached the matchers).
"""

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer
from transformers import LogitsProcessor, LogitsProcessorList, MiniMaxM3SparseForConditionalGeneration

from m3stack.engine.runtime import offline
from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.request import FinishReason, SamplingParams
from m3stack.engine.runtime.validation import build_request

NEW_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
    # Compact separators: random weights would otherwise spend the token budget on whitespace.
    "x-guidance": {"whitespace_flexible": False},
}
JSON_GRAMMAR = f"start: %json{json.dumps(SCHEMA)}"


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(380) for _ in range(length)]


def _run(core, sampling: dict[str, SamplingParams], prompts: dict[str, list[int]]) -> dict[str, offline.Generation]:
    requests = [build_request(core.info, rid, prompts[rid], params) for rid, params in sampling.items()]
    results = offline.generate(core, requests, check_invariants=True)
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_usable_blocks
    return results


def _greedy(**controls) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **controls)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


class OpenAIControls(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens, then logit bias: the documented formula."""

    def __init__(self, prompt_length: int, presence: float, frequency: float, bias: dict[int, float]) -> None:
        self.prompt_length, self.presence, self.frequency, self.bias = prompt_length, presence, frequency, bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        generated = input_ids[0, self.prompt_length :].tolist()
        for token in set(generated):
            scores[0, token] -= self.frequency * generated.count(token) + self.presence
        for token, value in self.bias.items():
            scores[0, token] += value
        return scores


def _hf_greedy(hf_model, prompt: list[int], processors: list | None = None, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, logits_processor=LogitsProcessorList(processors or []),
                                **kwargs)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plus_100_on_one_id_makes_greedy_emit_only_that_id(build_core, async_scheduling):
    core = build_core(async_scheduling=async_scheduling)
    prompts = {"biased": _prompt(1, 20), "free": _prompt(1, 20)}
    results = _run(core, {"biased": _greedy(logit_bias=((123, 100.0),)), "free": _greedy()}, prompts)
    assert results["biased"].token_ids == [123] * NEW_TOKENS
    assert results["free"].token_ids.count(123) < NEW_TOKENS // 2


def test_a_frequency_penalty_ends_the_loop_greedy_falls_into(build_core, hf_model):
    """A small bias on one token traps greedy decoding in a one-token loop; a frequency penalty pays for each
    repeat and ends it, token for token as transformers with OpenAI's formula does."""
    prompt = _prompt(2, 30)
    loop_token = 77
    bias = ((loop_token, 4.0),)
    core = build_core()
    looping = _run(core, {"loop": _greedy(logit_bias=bias)}, {"loop": prompt})["loop"].token_ids
    assert looping[4:] == [loop_token] * (NEW_TOKENS - 4), "the premise: greedy decoding loops on the biased token"
    params = {"penalized": _greedy(logit_bias=bias, frequency_penalty=1.5, presence_penalty=0.25)}
    for async_scheduling in (False, True):
        penalized = _run(build_core(async_scheduling=async_scheduling), params, {"penalized": prompt})
        tokens = penalized["penalized"].token_ids
        assert tokens.count(loop_token) <= 4 and len(set(tokens[-12:])) > 6
        reference = OpenAIControls(len(prompt), presence=0.25, frequency=1.5, bias=dict(bias))
        assert tokens == _hf_greedy(hf_model, prompt, [reference])


def test_repetition_penalty_changes_greedy_as_transformers_does(build_core, hf_model):
    prompt = [*_prompt(3, 12)] * 3  # repeated prompt tokens: the penalty covers the prompt too
    results = _run(build_core(), {"plain": _greedy(), "penalized": _greedy(repetition_penalty=1.8)},
                   {"plain": prompt, "penalized": prompt})  # fmt: skip
    assert results["penalized"].token_ids != results["plain"].token_ids
    assert results["penalized"].token_ids == _hf_greedy(hf_model, prompt, repetition_penalty=1.8)
    assert results["plain"].token_ids == _hf_greedy(hf_model, prompt)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_weights_under_a_json_schema_produce_valid_json(build_core, tiny_model_dir, async_scheduling):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    core = build_core(async_scheduling=async_scheduling)
    sampling = {f"s{seed}": SamplingParams(temperature=1.0, seed=seed, max_new_tokens=200, grammar=JSON_GRAMMAR)
                for seed in range(4)}  # fmt: skip
    results = _run(core, sampling, {rid: _prompt(4, 9) for rid in sampling})
    for rid, result in results.items():
        assert result.finish_reason is FinishReason.STOP, (rid, result.finish_reason)
        document = json.loads(tokenizer.decode(result.token_ids))
        jsonschema.validate(document, {k: v for k, v in SCHEMA.items() if k != "x-guidance"})


def test_a_tool_call_grammar_forces_a_call_block(build_core, tiny_model_dir):
    tool = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
            "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    grammar = f'start: "CALL get_weather " %json{json.dumps(tool)} " END"'
    sampling = {"call": SamplingParams(temperature=1.0, seed=7, max_new_tokens=120, grammar=grammar)}
    result = _run(build_core(), sampling, {"call": _prompt(5, 11)})["call"]
    text = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(result.token_ids)
    assert text.startswith("CALL get_weather ") and text.endswith(" END")
    assert set(json.loads(text.removeprefix("CALL get_weather ").removesuffix(" END"))) == {"city"}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_free_requests_beside_constrained_ones_equal_an_unconstrained_run(build_core, tiny_model_dir, async_scheduling):
    prompts = {f"r{i}": _prompt(10 + i, 9 + 7 * i) for i in range(5)}
    free = {rid: _greedy() for rid in ("r0", "r2", "r4")}
    alone = _run(build_core(async_scheduling=async_scheduling, max_num_batched_tokens=32), free, prompts)
    mixed_sampling = {
        **free,
        "r1": SamplingParams(temperature=0.0, max_new_tokens=200, grammar=JSON_GRAMMAR),
        "r3": _greedy(frequency_penalty=1.0, logit_bias=((5, 3.0),)),
    }
    mixed = _run(build_core(async_scheduling=async_scheduling, max_num_batched_tokens=32), mixed_sampling, prompts)
    for rid in free:
        assert mixed[rid].token_ids == alone[rid].token_ids, rid
    json.loads(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(mixed["r1"].token_ids))


def test_a_grammar_that_does_not_compile_is_refused(build_core):
    core = build_core()
    request = build_request(core.info, "bad", [1, 2, 3], SamplingParams(grammar='start: "{" value "}"'))
    with pytest.raises(InvalidRequestError, match=r"the grammar does not compile: .*value"):
        core.add_request(request)
    assert not core.has_work


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_logprobs_match_a_full_forward(build_core, hf_model, top):
    """Chunked prefill (chunks of 16 over a 45-token prompt), and a second request whose prompt is fully cached:
    both report every prompt token's logprob under the model, as one forward of the whole prompt gives them."""
    prompt = _prompt(6, 45)
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    core = build_core(max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=top)
    for attempt in ("cold", "cached"):
        result = _run(core, {attempt: params}, {attempt: prompt})[attempt]
        assert result.prompt_logprobs is not None
        torch.testing.assert_close(torch.tensor(result.prompt_logprobs.logprobs), expected, atol=1e-4, rtol=1e-4)
        if top:
            expected_top = logits.log_softmax(-1)[:-1].topk(top, dim=-1)
            assert [ids for ids, _ in result.prompt_logprobs.top] == expected_top.indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in result.prompt_logprobs.top]), expected_top.values,
                                       atol=1e-4, rtol=1e-4)  # fmt: skip
        else:
            assert result.prompt_logprobs.top == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_by_recompute_keeps_penalized_and_constrained_tokens(build_core, async_scheduling):
    """Preempted requests give back their KV, not their token counts or matcher state: the same tokens as a
    roomy run."""
    prompts = {f"r{i}": _prompt(40 + i, 40) for i in range(4)}
    sampling = {
        "r0": SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, frequency_penalty=1.0),
        "r1": SamplingParams(temperature=0.0, max_new_tokens=30, grammar=JSON_GRAMMAR),
        "r2": SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, repetition_penalty=1.5),
        "r3": SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True, presence_penalty=1.0),
    }
    roomy = _run(build_core(async_scheduling=async_scheduling), sampling, prompts)
    tight = build_core(num_kv_blocks=14, max_model_len=80, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    squeezed = _run(tight, sampling, prompts)
    assert tight.scheduler.num_preemptions > 0
    assert {rid: r.token_ids for rid, r in squeezed.items()} == {rid: r.token_ids for rid, r in roomy.items()}
