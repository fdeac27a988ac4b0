"""ChoiceDecoder: the same tokens give the same text, counts and logprobs however the engine groups
them into chunks (one token per chunk takes the decoder's short path, several the general one)."""

import random
import secrets

from m3stack.gateway.engine_client.events import Completion, TokenChunk
from m3stack.gateway.generation.choice import ChoiceDecoder


def decode_stream(tokenizer, prompt, ids, sizes, stop_strings=(), logprobs=None):
    decoder = ChoiceDecoder(3, tokenizer, prompt, stop_strings, True, tokenizer.eos_token_ids)
    deltas, position = [], 0
    for size in sizes:
        chunk_ids = ids[position : position + size]
        chunk_logprobs = logprobs[position : position + size] if logprobs is not None else ()
        position += size
        deltas.append(decoder.on_event(TokenChunk(chunk_ids, cached_tokens=7, logprobs=chunk_logprobs)))
        if decoder.finished:
            return decoder, deltas
    deltas.append(decoder.on_event(Completion("length", completion_tokens=len(ids), cached_tokens=7)))
    return decoder, deltas


def random_sizes(rng, total):
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.randint(1, 4))
    return sizes


def test_one_token_chunks_and_grouped_chunks_agree_with_transformers(tokenizer, hf_tokenizer):
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    prompt = hf_tokenizer.encode("Write:", add_special_tokens=False)
    for _ in range(20):
        text = "".join(rng.choice(["ab ", "ä", "你", "🙂", " x", "\n"]) for _ in range(rng.randint(1, 25)))
        ids = [i if rng.random() > 0.2 else rng.randrange(tokenizer.vocab_size) for i in hf_tokenizer.encode(text)]
        expected = hf_tokenizer.decode(ids, skip_special_tokens=True)
        one, one_deltas = decode_stream(tokenizer, prompt, ids, [1] * len(ids))
        grouped, grouped_deltas = decode_stream(tokenizer, prompt, ids, random_sizes(rng, len(ids)))
        for decoder, deltas in ((one, one_deltas), (grouped, grouped_deltas)):
            assert "".join(d.text for d in deltas) == expected, (seed, ids)
            assert decoder.completion_tokens == len(ids) and decoder.cached_tokens == 7
            assert [d.num_tokens for d in deltas[:-1]] == [d.num_tokens for d in deltas[:-1] if d.num_tokens]
            assert sum(d.num_tokens for d in deltas) == len(ids)
            assert all(d.index == 3 and d.logprobs == [] for d in deltas)
            assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_stop_strings_and_logprobs_take_the_general_path(tokenizer, hf_tokenizer):
    ids = hf_tokenizer.encode(" one two three four", add_special_tokens=False)
    _, deltas = decode_stream(tokenizer, [], ids, [1] * len(ids), stop_strings=["three"])
    assert "".join(d.text for d in deltas) == " one two "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "three"
    values = [-0.5 * (i + 1) for i in range(len(ids))]
    _, deltas = decode_stream(tokenizer, [], ids, [1] * len(ids), logprobs=values)
    assert [entry.logprob for d in deltas for entry in d.logprobs] == values
    assert [entry.token_id for d in deltas for entry in d.logprobs] == ids


def test_logprob_offsets_index_the_text_however_the_engine_groups_the_tokens(tokenizer, hf_tokenizer):
    """A token's offset is where its text starts in the choice's text: the bytes of one character all start where
    it does, a skipped special token takes no room; past a stop string nothing points beyond the text."""
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    special = tokenizer.token_to_id("<filename>")
    for _ in range(20):
        pieces = [rng.choice(["ab ", "ä", "你", "🙂", " x"]) for _ in range(rng.randint(1, 12))]
        ids = []
        for piece in pieces:  # a special token only between characters
            ids += hf_tokenizer.encode(piece, add_special_tokens=False) + ([special] if rng.random() < 0.3 else [])
        values = [-1.0] * len(ids)
        before = [hf_tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids))]
        before = [text.removesuffix("\ufffd") for text in before]  # an incomplete character is not shown yet
        for sizes in ([1] * len(ids), random_sizes(rng, len(ids))):
            _, deltas = decode_stream(tokenizer, [], ids, sizes, logprobs=values)
            assert [e.text_offset for d in deltas for e in d.logprobs] == [len(text) for text in before], (seed, ids)
            stop = rng.choice(pieces).strip() or "ab"
            _, deltas = decode_stream(tokenizer, [], ids, sizes, stop_strings=[stop], logprobs=values)
            text = "".join(d.text for d in deltas)
            assert all(e.text_offset <= len(text) for d in deltas for e in d.logprobs), (seed, ids, stop)
