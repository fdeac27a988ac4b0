"""The OpenAI API through the official ``openai`` client, against a real engine (tiny model, CPU)."""

import base64
import io
import itertools

import pytest

pytestmark = pytest.mark.xdist_group("gateway_api")

MESSAGES = [{"role": "user", "content": "Write one sentence about sparse attention."}]
EXACT = {"ignore_eos": True}  # exactly max_tokens tokens, whatever the random weights say


def token_ids_of(logprobs_content) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in logprobs_content]


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_extra["max_model_len"] == 256


def test_chat_stream_and_non_stream_agree_with_the_tokens(client, model_name, hf_tokenizer):
    body = dict(model=model_name, messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True)
    extra = {**EXACT, "return_tokens_as_token_ids": True}
    full = client.chat.completions.create(**body, extra_body=extra)
    choice = full.choices[0]
    ids = token_ids_of(choice.logprobs.content)
    assert len(ids) == 24 == full.usage.completion_tokens
    assert choice.finish_reason == "length"
    # The text is exactly the detokenized ids, and the prompt is what transformers' template gives.
    assert choice.message.content == hf_tokenizer.decode(ids, skip_special_tokens=True)
    prompt_ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert full.usage.prompt_tokens == len(prompt_ids)

    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 24
    content = [c.choices[0] for c in chunks if c.choices]
    streamed_ids = [i for c in content if c.logprobs for i in token_ids_of(c.logprobs.content)]
    assert streamed_ids == ids, "every token exactly once, in order"
    assert "".join(c.delta.content or "" for c in content) == choice.message.content
    assert [c.finish_reason for c in content if c.finish_reason] == ["length"]


def test_completions_text_token_ids_batches_and_echo(client, model_name, hf_tokenizer):
    text = "The quick brown fox"
    single = client.completions.create(model=model_name, prompt=text, max_tokens=4, temperature=0, extra_body=EXACT)
    assert single.usage.prompt_tokens == len(hf_tokenizer(text)["input_ids"])
    assert single.usage.completion_tokens == 4 and single.choices[0].finish_reason == "length"

    ids = hf_tokenizer(text)["input_ids"]
    from_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0, extra_body=EXACT)
    assert from_ids.choices[0].text == single.choices[0].text

    batch = client.completions.create(
        model=model_name, prompt=[text, "Hello"], n=2, max_tokens=3, seed=1, extra_body=EXACT
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(ids) + len(hf_tokenizer("Hello")["input_ids"])
    assert batch.usage.completion_tokens == 4 * 3

    echoed = client.completions.create(
        model=model_name, prompt=text, max_tokens=4, temperature=0, echo=True, extra_body=EXACT
    )
    assert echoed.choices[0].text == text + single.choices[0].text


def test_n_choices_differ_and_a_seed_repeats_them(client, model_name):
    def sample(seed: int) -> list[str]:
        response = client.chat.completions.create(
            model=model_name, messages=MESSAGES, n=3, temperature=1.0, seed=seed, max_tokens=12, extra_body=EXACT
        )
        assert sorted(c.index for c in response.choices) == [0, 1, 2]
        assert response.usage.completion_tokens == 36
        return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert len(set(first)) == 3, first
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_string_split_across_chunks_is_trimmed(client, model_name):
    body = dict(model=model_name, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body=EXACT)
    deltas = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
    text = "".join(deltas)
    # A stop string made of the last character of one delta and the first of the next.
    boundaries = []
    position = 0
    for before, after in itertools.pairwise(deltas):
        position += len(before)
        if before and after and position >= 4:
            boundaries.append(position)
    assert boundaries, deltas
    boundary = boundaries[len(boundaries) // 2]
    stop = text[boundary - 1 : boundary + 1]
    expected = text[: text.find(stop)]

    stopped = client.completions.create(**body, stop=[stop])
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop
    assert stopped.usage.completion_tokens < 24
    streamed = list(client.completions.create(**body, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_choice(client, model_name, hf_tokenizer):
    body = dict(model=model_name, messages=MESSAGES, temperature=0, max_tokens=16, logprobs=True)
    free = client.chat.completions.create(**body, extra_body={**EXACT, "return_tokens_as_token_ids": True})
    ids = token_ids_of(free.choices[0].logprobs.content)
    stop_id = ids[5]
    first = ids.index(stop_id)
    stopped = client.chat.completions.create(
        **body, extra_body={"stop_token_ids": [stop_id], "return_tokens_as_token_ids": True}
    )
    choice = stopped.choices[0]
    assert token_ids_of(choice.logprobs.content) == ids[:first]
    assert choice.message.content == hf_tokenizer.decode(ids[:first], skip_special_tokens=True)
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id


def test_max_completion_tokens_wins_over_max_tokens(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=5, max_tokens=50, extra_body=EXACT
    )
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"


def test_logprobs_are_consistent(client, model_name):
    chat = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body=EXACT,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 6
    for entry in entries:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0
        assert entry.logprob == pytest.approx(top[0], abs=1e-5), "greedy picks the most likely token"

    completion = client.completions.create(
        model=model_name, prompt="Once", max_tokens=5, logprobs=2, temperature=0, extra_body=EXACT
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 5
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(value <= 0 for value in logprobs.token_logprobs)


def test_completion_text_offsets_index_the_returned_text(client, model_name, tokenizer):
    """``text_offset[i]`` is where token i's text starts in the choice's text: a special token the completion
    leaves out of its text, and the bytes of one character (each reported as U+FFFD), take no room of their own."""
    letter, special = tokenizer.token_to_id("a"), tokenizer.token_to_id("<filename>")
    euro = tokenizer.encode("€", add_special_tokens=False)
    assert len(euro) == 3
    prompt = [letter, special, *euro, letter]  # echoed as "a<filename>€a"
    body = dict(model=model_name, prompt=prompt, max_tokens=12, logprobs=1, echo=True, seed=7)
    extra = {**EXACT, "logit_bias": {str(letter): 100, str(special): 100}}
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**body, stream=True, extra_body=extra))
            text = "".join(c.choices[0].text for c in chunks)
            tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        else:
            choice = client.completions.create(**body, extra_body=extra).choices[0]
            text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
        generated = tokens[len(prompt) :]
        assert set(generated) == {"a", "<filename>"}, generated  # both, in some order
        assert text == "a<filename>€a" + "a" * generated.count("a")
        assert offsets[: len(prompt)] == [0, 1, 11, 11, 11, 12], stream
        echoed = len("a<filename>€a")
        assert offsets[len(prompt) :] == [echoed + generated[:i].count("a") for i in range(len(generated))], stream


def png_data_url(width: int = 56, height: int = 56) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng()
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_image_parts_reach_the_engine(client, model_name):
    text_only = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Describe it."}], max_tokens=2, extra_body=EXACT
    )
    content = [{"type": "image_url", "image_url": {"url": png_data_url()}}, {"type": "text", "text": "Describe it."}]
    with_image = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": content}], max_tokens=2, extra_body=EXACT
    )
    # 56x56 pixels = a 4x4 grid of 14-pixel patches, merged 2x2: 4 placeholder tokens between the
    # start and end markers, where the template wrote one image marker.
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + 4 + 2
