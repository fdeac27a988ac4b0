"""The gateway's tokenizer and chat template against transformers' AutoTokenizer on the tiny model."""

import json
import random
import secrets

import pytest

from m3stack.gateway.tokenize.chat_template import ChatTemplate, ChatTemplateError
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer, TokenizerLoadError

SAMPLE_TEXTS = [
    "hello world",
    "  leading and trailing spaces  ",
    "ünïcödé, 你好, 🙂🚀 and a zero-width joiner: 👩‍💻",
    "special tokens inline: ]~!b[ system [e~[ ]<]image[>[ end",
    "line\nbreaks\r\nand\ttabs",
    "",
]


def random_text(rng: random.Random, length: int) -> str:
    pools = ["abcdefghij ", "äöüß€", "你好世界", "🙂🚀👩‍💻", "\n\t", "]~b][e~["]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(length))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    texts = SAMPLE_TEXTS + [random_text(rng, rng.randint(1, 80)) for _ in range(30)]
    for text in texts:
        expected = hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, (seed, text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, skip_special_tokens):
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, (seed, ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_bound_and_single_token_decoders_match_transformers(tiny_model_dir, hf_tokenizer, skip_special_tokens):
    """Every id of the vocabulary, twice (the second answer comes from the cache), in a random order,
    from a tokenizer that has decoded with the other flag first: the two caches must stay apart."""
    tokenizer = ModelTokenizer.from_folder(tiny_model_dir)
    other = tokenizer.single_token_decoder(not skip_special_tokens)
    ids = list(range(tokenizer.vocab_size))
    random.Random(secrets.randbits(32)).shuffle(ids)
    for token_id in ids:
        other(token_id)
    decode_one = tokenizer.single_token_decoder(skip_special_tokens)
    decode = tokenizer.decoder(skip_special_tokens)
    special = [tokenizer.token_to_id(token) for token in tokenizer.special_tokens.values()]
    assert any(hf_tokenizer.decode([i], skip_special_tokens=skip_special_tokens) == "" for i in special) == (
        skip_special_tokens
    )
    for _ in range(2):
        for token_id in ids:
            expected = hf_tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
            assert decode_one(token_id) == expected, token_id
            assert decode([token_id]) == expected, token_id
    assert tokenizer.token_text(special[0]) == hf_tokenizer.decode([special[0]], skip_special_tokens=False)


def test_special_tokens_and_eos_come_from_the_folder(tokenizer, hf_tokenizer):
    assert tokenizer.special_tokens["bos_token"] == hf_tokenizer.bos_token
    assert tokenizer.special_tokens["eos_token"] == hf_tokenizer.eos_token
    assert hf_tokenizer.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(hf_tokenizer)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour. 🙂"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [{"role": "developer", "content": "rules"}, {"role": "user", "content": "你好"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    template = ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens)
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    expected_text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected_text
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert tokenizer.encode(text, add_special_tokens=False) == list(expected_ids)


def test_template_runs_in_a_sandbox():
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])


def test_template_raise_exception_becomes_a_chat_template_error():
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}", {}
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render([{"role": "assistant", "content": "x"}])
    assert strict.render([{"role": "user", "content": "x"}]) == ""


def test_request_variables_cannot_replace_the_messages():
    echo = ChatTemplate("{{ messages[0].content }}|{{ flavour }}", {})
    rendered = echo.render(
        [{"role": "user", "content": "real"}], extra_variables={"messages": [{"content": "fake"}], "flavour": "x"}
    )
    assert rendered == "real|x"


def test_template_syntax_error_is_reported():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}", {})


def test_missing_or_broken_tokenizer_files_give_clear_errors(tmp_path, tiny_model_dir):
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        ModelTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="cannot be loaded"):
        ModelTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerLoadError, match="expected a JSON object"):
        ModelTokenizer.from_folder(tmp_path)


def test_chat_template_precedence(tmp_path, tiny_model_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from-config"}))
    assert ModelTokenizer.from_folder(tmp_path).chat_template == "from-config"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from-json"}))
    assert ModelTokenizer.from_folder(tmp_path).chat_template == "from-json"
    (tmp_path / "chat_template.jinja").write_text("from-jinja")
    assert ModelTokenizer.from_folder(tmp_path).chat_template == "from-jinja"
