"""Penalties, logit_bias and echo with prompt logprobs through the official ``openai`` client, against a real
engine (tiny model, CPU) behind a real gateway; prompt logprobs checked against a full forward of transformers."""

import random

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration

pytestmark = pytest.mark.xdist_group("gateway_api")

MESSAGES = [{"role": "user", "content": "Name three colours."}]
IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}  # exactly max_tokens tokens, named by id


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ids(entries) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in entries]


def _chat_ids(client, model_name, max_tokens: int = 12, **controls) -> list[int]:
    extra = {**IDS, **controls.pop("extra_body", {})}
    response = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0, logprobs=True,
                                              max_tokens=max_tokens, extra_body=extra, **controls)  # fmt: skip
    return _ids(entry.token for entry in response.choices[0].logprobs.content)


def test_plus_100_logit_bias_makes_greedy_emit_only_that_id(client, model_name):
    assert _chat_ids(client, model_name, logit_bias={"57": 100}) == [57] * 12
    completion = client.completions.create(model=model_name, prompt="Once upon", max_tokens=6, temperature=0,
                                           logprobs=0, logit_bias={"201": 100}, extra_body=IDS)  # fmt: skip
    assert _ids(completion.choices[0].logprobs.tokens) == [201] * 6


def test_frequency_and_presence_penalties_end_a_greedy_loop(client, model_name):
    """A small bias traps greedy decoding in a one-token loop; frequency and presence penalties break it."""
    loop = _chat_ids(client, model_name, max_tokens=16, logit_bias={"57": 4})
    assert loop[-8:] == [57] * 8, "the premise: a small bias traps greedy decoding in a one-token loop"
    penalized = _chat_ids(client, model_name, max_tokens=16, logit_bias={"57": 4}, frequency_penalty=1.5)
    assert penalized.count(57) <= 4
    presence = _chat_ids(client, model_name, max_tokens=16, logit_bias={"57": 4}, presence_penalty=2.0,
                         frequency_penalty=0.5)  # fmt: skip
    assert presence.count(57) < loop.count(57)


def test_repetition_penalty_gives_transformers_tokens(client, model_name, hf_model):
    rng = random.Random(3)
    prompt = [rng.randrange(380) for _ in range(12)] * 3  # repeated prompt tokens: the penalty covers them

    def greedy(**controls) -> list[int]:
        response = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                             logprobs=0, extra_body={**IDS, "min_tokens": 24, **controls})  # fmt: skip
        return _ids(response.choices[0].logprobs.tokens)

    with torch.inference_mode():
        expected = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                     do_sample=False, repetition_penalty=1.9)[0, len(prompt) :].tolist()  # fmt: skip
    penalized = greedy(repetition_penalty=1.9)
    assert penalized == expected and penalized != greedy()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_returns_the_prompt_logprobs_of_a_full_forward(client, model_name, hf_tokenizer, hf_model,
                                                                          stream):  # fmt: skip
    text = "The quick brown fox jumps over the lazy dog"
    prompt_ids = hf_tokenizer(text)["input_ids"]
    with torch.inference_mode():
        logprobs = hf_model(input_ids=torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    expected = logprobs[:-1].gather(-1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(-1).tolist()
    expected_top = logprobs[:-1].topk(2, dim=-1)

    body = dict(model=model_name, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2, extra_body=IDS)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
        assert chunks[0].text == text, "the echoed prompt comes first, with its logprobs"
        text_out = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        token_logprobs = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        top = [v for c in chunks if c.logprobs for v in c.logprobs.top_logprobs]
    else:
        choice = client.completions.create(**body).choices[0]
        text_out, tokens = choice.text, choice.logprobs.tokens
        token_logprobs, top = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
        assert choice.logprobs.text_offset[: len(prompt_ids)][0] == 0
    assert text_out.startswith(text)
    assert _ids(tokens)[: len(prompt_ids)] == prompt_ids and len(tokens) == len(prompt_ids) + 3
    assert token_logprobs[0] is None and top[0] is None
    assert token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
    for position in range(1, len(prompt_ids)):
        ranked = top[position]
        assert _ids(ranked) == expected_top.indices[position - 1].tolist()
        assert list(ranked.values()) == pytest.approx(expected_top.values[position - 1].tolist(), abs=1e-4)
