"""Prefix-cache keys: what makes two blocks equal, and what must not."""

import random

from m3stack.engine.kv_cache.prefix_cache import ROOT_HASH, extend_block_hashes, hash_block

BLOCK = 4


def _hashes(request) -> list[bytes]:
    extend_block_hashes(request, BLOCK)
    return request.block_hashes


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_only_full_blocks_are_hashed(new_request):
    assert len(_hashes(new_request(_tokens(11, 0)))) == 2
    assert len(_hashes(new_request(_tokens(12, 0)))) == 3


def test_equal_prefixes_give_equal_chains_and_a_change_breaks_the_rest(new_request):
    tokens = _tokens(16, 1)
    changed = list(tokens)
    changed[9] += 1  # inside block 2
    a, b = _hashes(new_request(tokens)), _hashes(new_request(changed))
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # the chain carries the difference forward


def test_same_block_tokens_after_different_parents_differ():
    block = _tokens(BLOCK, 2)
    assert hash_block(ROOT_HASH, block) != hash_block(hash_block(ROOT_HASH, block), block)


def test_salt_separates_every_block(new_request):
    tokens = _tokens(12, 3)
    plain, salted, other = (_hashes(new_request(tokens, salt=s)) for s in ("", "tenant-a", "tenant-b"))
    assert all(x != y for x, y in zip(plain, salted, strict=True))
    assert all(x != y for x, y in zip(salted, other, strict=True))
    assert _hashes(new_request(tokens, salt="tenant-a")) == salted


def test_multimodal_hash_enters_only_the_blocks_its_span_touches(new_request, new_image):
    tokens = [7] * 16  # identical placeholder tokens: only the content hash tells images apart
    cat = _hashes(new_request(tokens, mm_inputs=[new_image("cat", range(5, 9))]))
    dog = _hashes(new_request(tokens, mm_inputs=[new_image("dog", range(5, 9))]))
    # Span [5, 9) touches blocks 1 and 2; block 0 is equal, blocks >= 1 differ (the chain).
    assert cat[0] == dog[0]
    assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))
    # The same image at the same place hashes equally.
    assert _hashes(new_request(tokens, mm_inputs=[new_image("cat", range(5, 9))])) == cat


def test_token_values_are_not_confused_by_packing():
    # Distinct token lists that a naive byte concatenation could alias.
    assert hash_block(ROOT_HASH, [1, 256]) != hash_block(ROOT_HASH, [256, 1])
    assert hash_block(ROOT_HASH, [1], ["ab"]) != hash_block(ROOT_HASH, [1], ["a", "b"])
    assert hash_block(ROOT_HASH, [1], [], "s") != hash_block(ROOT_HASH, [1], ["s"])


def test_hashes_extend_as_tokens_are_generated(new_request):
    request = new_request(_tokens(6, 4))
    assert len(_hashes(request)) == 1
    for token in (11, 12):
        request.append_placeholder()
        request.resolve_placeholder(token)
    whole = new_request(request.token_ids)
    assert _hashes(request) == _hashes(whole) and len(whole.block_hashes) == 2


def test_the_incremental_chain_is_the_chain_of_hash_block(new_request):
    """extend_block_hashes hashes plain blocks inline and blocks with a salt through hash_block's path; both
    must give hash_block's chain, also when the blocks arrive in several calls."""
    tokens = _tokens(22, 7)
    for salt in ("", "tenant"):
        request = new_request(tokens[:9])
        request.cache_salt = salt
        extend_block_hashes(request, BLOCK)
        request.token_ids.extend(tokens[9:])
        extend_block_hashes(request, BLOCK)
        expected, parent = [], ROOT_HASH
        for index in range(len(tokens) // BLOCK):
            parent = hash_block(parent, tokens[index * BLOCK : (index + 1) * BLOCK], salt=salt if index == 0 else "")
            expected.append(parent)
        assert request.block_hashes == expected
