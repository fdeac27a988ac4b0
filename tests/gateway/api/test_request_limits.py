"""Limits met before any work: fan-out (prompts, prompts x n, the engines' queues) is a 400 naming the limit,
never a 503 that retrying cannot fix; a prompt whose length proves it is over the context is a 400 without
being tokenized, and one the length bound lets through still gets today's exact count."""

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from m3stack.gateway.api.request_limits import RequestLimits, check_prompt_length
from m3stack.gateway.errors import APIError
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer, TokenizerFiles

pytestmark = pytest.mark.xdist_group("gateway_api")

CONTEXT = 256  # the engines of tests/gateway/api run with --max-model-len 256


@pytest.mark.parametrize(
    ("prompts", "n", "capacity", "code", "words"),
    [
        (256, 1, None, None, None),
        (1, 128, 1024, None, None),
        (257, 1, None, "too_many_prompts", "257 prompts exceed the limit of 256 per request (--max-request-prompts)"),
        (256, 16, None, "too_many_sequences", "= 4096 sequences exceed the limit of 256 per request (--max-request-se"),
        (2, 100, 150, "too_many_sequences", "200 sequences exceed what the engines can queue at once (150 requests"),
    ],
)
def test_fan_out_limits(prompts, n, capacity, code, words):
    if code is None:
        RequestLimits().check_fan_out(prompts, n, capacity)
        return
    with pytest.raises(APIError) as refused:
        RequestLimits().check_fan_out(prompts, n, capacity)
    assert (refused.value.status, refused.value.code) == (400, code) and words in refused.value.message


def test_the_length_bound_refuses_only_what_cannot_fit():
    check_prompt_length(CONTEXT * 31 - 1, CONTEXT, 31, "prompt")
    check_prompt_length(10**9, CONTEXT, None, "prompt")  # no bound known: the exact count decides
    with pytest.raises(APIError) as refused:
        check_prompt_length(CONTEXT * 31, CONTEXT, 31, "prompt")
    assert refused.value.code == "context_length_exceeded" and "at least 256 tokens" in refused.value.message


def test_no_text_has_fewer_tokens_than_the_bound_says(tiny_model_dir):
    """The bound's premise on the real tokenizer: a text of C characters has at least C / max_chars_per_token
    tokens, also for texts built from the longest tokens and the special tokens (the tightest cases)."""
    tokenizer = ModelTokenizer.from_folder(tiny_model_dir)
    bound = tokenizer.max_chars_per_token
    vocabulary = sorted(tokenizer._tokenizer.get_vocab(with_added_tokens=True), key=len, reverse=True)
    texts = [
        "".join(vocabulary[:40]) * 3,
        vocabulary[0] * 50,
        " ".join(vocabulary[::7]),
        "\u2028é漢🙂 " * 300,
        "x" * 5000,
    ]
    for text in texts:
        assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)
    assert len(tokenizer.encode(vocabulary[0] * 50, add_special_tokens=False)) * bound == 50 * len(vocabulary[0])


def _tokenizer(normalizer=None, strip: bool = False) -> ModelTokenizer:
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken("<longest-special>", lstrip=strip)])
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return ModelTokenizer(tokenizer, TokenizerFiles())


def test_normalizers_that_may_delete_characters_turn_the_bound_off():
    assert _tokenizer().max_chars_per_token == len("<longest-special>")
    assert _tokenizer(normalizers.NFC()).max_chars_per_token == 4 * len("<longest-special>")
    assert _tokenizer(normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])).max_chars_per_token == 17
    assert _tokenizer(normalizers.Replace("x", "")).max_chars_per_token is None
    assert _tokenizer(normalizers.Strip()).max_chars_per_token is None
    assert _tokenizer(strip=True).max_chars_per_token is None


def _post(gateway, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}{path}", json=body, timeout=120)


def test_a_prompt_the_length_bound_refuses_is_a_400_with_a_lower_bound(gateway, model_name, tiny_model_dir):
    longest = ModelTokenizer.from_folder(tiny_model_dir).max_chars_per_token
    body = {"model": model_name, "messages": [{"role": "user", "content": "x" * 2_000_000}], "max_tokens": 1}
    error = _post(gateway, "/v1/chat/completions", body).json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert error["message"].startswith(
        f"This model's maximum context length is {CONTEXT} tokens, but the prompt has at least "
        f"{-(-2_000_000 // longest)} tokens (2000000 characters; no token of this model stands for more than {longest})"
    )
    text = "y" * CONTEXT * longest  # the shortest text the bound refuses
    error = _post(gateway, "/v1/completions", {"model": model_name, "prompt": text}).json()["error"]
    assert error["code"] == "context_length_exceeded" and f"at least {CONTEXT} tokens" in error["message"]


def test_a_prompt_under_the_length_bound_but_over_the_context_keeps_the_exact_count(gateway, model_name, hf_tokenizer):
    text = "word " * 1000  # 5000 characters: under the bound, so it is tokenized
    error = _post(gateway, "/v1/completions", {"model": model_name, "prompt": text, "max_tokens": 1}).json()["error"]
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens, but the prompt has "
        f"{len(hf_tokenizer(text)['input_ids'])} tokens (no room left to generate). Shorten the prompt."
    )


def test_fan_out_over_the_limits_is_a_400_naming_them(gateway, model_name):
    many = {"model": model_name, "prompt": ["hi"] * 256, "n": 16, "max_tokens": 1}
    error = _post(gateway, "/v1/completions", many).json()["error"]
    assert (error["code"], error["param"]) == ("too_many_sequences", "n")
    assert "4096 sequences exceed the limit of 256 per request (--max-request-sequences)" in error["message"]
    error = _post(gateway, "/v1/completions", {**many, "prompt": ["hi"] * 300, "n": 1}).json()["error"]
    assert (error["code"], error["param"]) == ("too_many_prompts", "prompt")
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": 1}
    assert _post(gateway, "/v1/chat/completions", chat).status_code == 200


def test_fan_out_beyond_the_engines_queues_is_a_400_not_a_503(stack, model_name):
    engine = stack.engine("--max-queue", "8")
    gateway = stack.gateway([engine], "--media-workers", "0", "--max-request-sequences", "4096")
    body = {"model": model_name, "prompt": ["hi"] * 4, "n": 3, "max_tokens": 1}
    response = _post(gateway, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "12 sequences exceed what the engines can queue at once (8 requests" in response.json()["error"]["message"]
    assert _post(gateway, "/v1/completions", {**body, "n": 2}).status_code == 200
