"""Incremental detokenization: deltas add up to the full decode and never split a character."""

import random
import secrets

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from m3stack.gateway.tokenize.detokenizer import REPLACEMENT_CHARACTER, IncrementalDetokenizer
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer


def stream(tokenizer: ModelTokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(lambda chunk: tokenizer.decode(chunk, skip_special_tokens=skip), prompt)
    return [detokenizer.push(token) for token in ids] + [detokenizer.finish()]


def test_multibyte_characters_are_never_split(tokenizer, hf_tokenizer):
    text = "a🙂b你好ü🚀"
    # Byte-level tokens: every byte its own token, so each emoji spans four tokens.
    ids = [tokenizer.token_to_id(hf_tokenizer.convert_ids_to_tokens(i)) for i in hf_tokenizer.encode(text)]
    byte_ids = []
    for token_id in ids:
        byte_ids += [hf_tokenizer.convert_tokens_to_ids(char) for char in hf_tokenizer.convert_ids_to_tokens(token_id)]
    assert hf_tokenizer.decode(byte_ids) == text
    deltas = stream(tokenizer, byte_ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHARACTER not in delta for delta in deltas)
    # The emoji arrives whole, with the delta of its last byte.
    assert "🙂" in deltas


def test_random_sequences_add_up_to_the_transformers_decode(tokenizer, hf_tokenizer):
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for _ in range(40):
        text = "".join(rng.choice(["ab ", "ä", "你", "🙂", "[e~[", " x", "\n"]) for _ in range(rng.randint(1, 30)))
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        # Shuffle in random tokens too, including lone bytes that form no character.
        ids = [i if rng.random() > 0.2 else rng.randrange(tokenizer.vocab_size) for i in ids]
        deltas = stream(tokenizer, ids)
        expected = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == expected, (seed, ids)
        shown = ""
        for delta in deltas:
            shown += delta
            assert expected.startswith(shown), (seed, ids, deltas)


def test_prompt_context_changes_nothing_for_byte_level(tokenizer, hf_tokenizer):
    prompt = hf_tokenizer.encode("The answer is", add_special_tokens=False)
    output = hf_tokenizer.encode(" forty-two 🙂.", add_special_tokens=False)
    assert "".join(stream(tokenizer, output, prompt)) == hf_tokenizer.decode(output)


def test_prompt_ending_inside_a_character_is_not_glued_to_the_output(tokenizer, hf_tokenizer):
    emoji_bytes = [
        hf_tokenizer.convert_tokens_to_ids(c)
        for c in hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("🙂", add_special_tokens=False))[0]
    ]
    prompt = hf_tokenizer.encode("x", add_special_tokens=False) + emoji_bytes[:2]
    output = hf_tokenizer.encode(" ok", add_special_tokens=False)
    assert "".join(stream(tokenizer, output, prompt)) == " ok"


def test_metaspace_leading_space_is_rendered_in_context():
    """Metaspace decoders drop the first token's leading space; the prompt context keeps it."""
    vocab = {"▁hello": 0, "▁world": 1, "▁again": 2, "<unk>": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    decode = raw.decode
    assert decode([1]) == "world"  # alone, the space is gone
    detokenizer = IncrementalDetokenizer(decode, prompt_ids=[0])
    text = detokenizer.push(1) + detokenizer.push(2) + detokenizer.finish()
    assert text == decode([0, 1, 2])[len(decode([0])) :] == " world again"


def test_skipped_special_tokens_are_consumed_without_text(tokenizer):
    eos = tokenizer.token_to_id("[e~[")
    word = tokenizer.encode("hi", add_special_tokens=False)
    assert "".join(stream(tokenizer, [*word, eos, *word])) == "hihi"
    assert "".join(stream(tokenizer, [*word, eos], skip=False)) == "hi[e~["


def test_invalid_bytes_are_released_after_a_bounded_wait(tokenizer, hf_tokenizer):
    lone_continuation = hf_tokenizer.convert_tokens_to_ids(
        hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("ü", add_special_tokens=False))[0][-1]
    )
    deltas = stream(tokenizer, [lone_continuation] * 20)
    assert "".join(deltas) == hf_tokenizer.decode([lone_continuation] * 20)
    assert any(deltas[:-1]), "the invalid bytes must not all be held until the end"


def test_cached_single_token_texts_give_the_same_deltas(tokenizer, hf_tokenizer):
    """The gateway's wiring: the bound decoder plus the single-token cache, which must actually answer
    (most tokens move the window on by one) and give what decoding each window gives."""
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for skip in (True, False):
        cached = tokenizer.single_token_decoder(skip)
        answered = []

        def decode_one(token_id: int, cached=cached, answered=answered) -> str:
            answered.append(token_id)
            return cached(token_id)

        for _ in range(20):
            text = "".join(rng.choice(["ab ", "ä", "你", "🙂", "[e~[", " x", "\n"]) for _ in range(rng.randint(1, 30)))
            ids = [i if rng.random() > 0.2 else rng.randrange(tokenizer.vocab_size) for i in hf_tokenizer.encode(text)]
            prompt = hf_tokenizer.encode("Say:", add_special_tokens=False)
            detokenizer = IncrementalDetokenizer(tokenizer.decoder(skip), prompt, decode_one)
            deltas = [detokenizer.push(token) for token in ids] + [detokenizer.finish()]
            assert deltas == stream(tokenizer, ids, prompt, skip), (seed, skip, ids)
            assert "".join(deltas) == hf_tokenizer.decode(ids, skip_special_tokens=skip), (seed, skip, ids)
        assert len(answered) > 100, "the single-token path was not taken"
