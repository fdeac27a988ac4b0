"""Penalties, logit bias and grammar masks as the sampler applies them, against independent references.

The repetition penalty is compared with transformers' own ``RepetitionPenaltyLogitsProcessor``; presence and
frequency with OpenAI's documented formula written out per token; bitmask application with a per-bit loop and
llguidance's own mask of a real grammar.
"""

import json
import math

import llguidance
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from m3stack.engine.runtime.errors import InvalidRequestError
from m3stack.engine.runtime.grammar import GrammarCompiler, GrammarMasks, apply_bitmask, bitmask_words
from m3stack.engine.runtime.penalties import SCRATCH_SLOT, TokenCounts, apply_penalties
from m3stack.engine.runtime.request import FinishReason, RequestStatus, SamplingParams
from m3stack.engine.runtime.sampler import build_sampling_batch, sample
from tests.engine.conftest import make_request

VOCAB = 50
CPU = torch.device("cpu")


def _openai_reference(logits: list[float], generated: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = list(logits)
    for token in set(generated):
        count = generated.count(token)
        out[token] -= count * frequency + (1.0 if count > 0 else 0.0) * presence
    return out


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    history = [[1, 2, 2, 7], [3, 3, 3, 3], [10, 11, 40, 2]]  # prompt + generated, as HF sees input_ids
    prompts = [[1, 2], [3], [10, 11]]
    penalty = 1.7
    expected = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[r : r + 1].clone())
            for r, ids in enumerate(history)
        ]
    )
    counts = torch.zeros(3, VOCAB, dtype=torch.int32)
    in_prompt = torch.zeros(3, VOCAB, dtype=torch.bool)
    for row, (ids, prompt) in enumerate(zip(history, prompts, strict=True)):
        in_prompt[row, prompt] = True
        for token in ids[len(prompt) :]:
            counts[row, token] += 1
    neutral = torch.zeros(3)
    got = apply_penalties(logits, counts, in_prompt, neutral, neutral, torch.full((3,), penalty))
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_follow_openai_formula():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    generated = [[4, 4, 4, 9], [0, 49, 49]]
    presence, frequency = torch.tensor([0.5, -1.0]), torch.tensor([1.25, 0.3])
    counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    for row, ids in enumerate(generated):
        for token in ids:
            counts[row, token] += 1
    prompt = torch.zeros(2, VOCAB, dtype=torch.bool)
    prompt[:, 5] = True  # the prompt does not count for presence/frequency
    got = apply_penalties(logits, counts, prompt, presence, frequency, torch.ones(2))
    for row in range(2):
        expected = _openai_reference(logits[row].tolist(), generated[row], float(presence[row]), float(frequency[row]))
        assert got[row].tolist() == pytest.approx(expected, abs=1e-6)


def test_logit_bias_of_100_makes_greedy_pick_the_token():
    logits = torch.randn(2, VOCAB) * 5
    biased = make_request([1, 2], sampling=SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)))
    free = make_request([1, 2], sampling=SamplingParams(temperature=0.0))
    tokens = sample(logits.clone(), build_sampling_batch([biased, free], VOCAB, CPU))
    assert tokens[0].token_id == 17
    assert tokens[1].token_id == int(logits[1].argmax())


def test_negative_bias_bans_the_greedy_choice():
    logits = torch.randn(1, VOCAB)
    top = int(logits[0].argmax())
    request = make_request([1], sampling=SamplingParams(temperature=0.0, logit_bias=((top, -100.0),)))
    token = sample(logits.clone(), build_sampling_batch([request], VOCAB, CPU))[0].token_id
    assert token == int(logits[0].topk(2).indices[1])


def test_token_counts_follow_sampled_tokens_and_free_slots_of_ended_requests():
    counts = TokenCounts(max_requests=2, vocab_size=VOCAB, device=CPU)
    penalized = make_request([3, 4, 3], sampling=SamplingParams(temperature=0.0, frequency_penalty=1.0))
    free = make_request([5], sampling=SamplingParams(temperature=0.0))
    slots = counts.slots_for([penalized, free])
    assert slots[1] == SCRATCH_SLOT and slots[0] != SCRATCH_SLOT
    assert counts.in_prompt is not None and counts.counts is not None
    assert counts.in_prompt[slots[0]].nonzero().flatten().tolist() == [3, 4]
    for token in (7, 7, 8):
        counts.record(torch.tensor(slots), torch.tensor([token, token]))
    assert counts.counts[slots[0], 7] == 2 and counts.counts[slots[0], 8] == 1
    assert int(counts.counts[SCRATCH_SLOT].abs().sum()) == 0, "rows without penalties must not count"
    penalized.finish(FinishReason.LENGTH)
    other = make_request([9], sampling=SamplingParams(temperature=0.0, presence_penalty=1.0))
    reused = counts.slots_for([other])[0]
    assert counts.num_used_slots == 1
    assert int(counts.counts[reused].sum()) == 0 and counts.in_prompt[reused].nonzero().flatten().tolist() == [9]


def test_a_preempted_request_gives_up_its_slot_and_gets_its_counts_back():
    counts = TokenCounts(max_requests=1, vocab_size=VOCAB, device=CPU)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    first, second = make_request([3], sampling=params), make_request([4], sampling=params)
    slot = counts.slots_for([first])[0]
    first.append_placeholder()
    counts.record(torch.tensor([slot]), torch.tensor([7]))
    first.resolve_placeholder(7)
    first.transition(RequestStatus.PREFILLING)
    first.transition(RequestStatus.WAITING)  # preempted: it holds no KV and does not run
    assert counts.slots_for([second]) == [slot]
    assert counts.counts is not None and int(counts.counts[slot].sum()) == 0
    second.transition(RequestStatus.PREFILLING)  # running: its slot stays
    with pytest.raises(RuntimeError, match="more than 1 running requests use penalties"):
        counts.slots_for([first])
    second.finish(FinishReason.LENGTH)
    slot = counts.slots_for([first])[0]
    assert counts.counts[slot, 7] == 1 and counts.in_prompt is not None and bool(counts.in_prompt[slot, 3])


def test_a_penalized_batch_samples_its_free_rows_as_a_free_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    free = [make_request([1], sampling=SamplingParams(temperature=0.0)) for _ in range(2)]
    alone = sample(logits[1:].clone(), build_sampling_batch(free, VOCAB, CPU))
    penalized = make_request([int(logits[0].argmax())], sampling=SamplingParams(temperature=0.0, repetition_penalty=2))
    mixed = sample(logits.clone(), build_sampling_batch([penalized, *free], VOCAB, CPU))
    assert [t.token_id for t in mixed[1:]] == [t.token_id for t in alone]


def _reference_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    allowed = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool)
    for row in range(bitmask.shape[0]):
        for token in range(vocab_size):
            allowed[row, token] = bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
    return allowed


@pytest.mark.parametrize("vocab_size", [31, 32, 77])
def test_apply_bitmask_masks_exactly_the_cleared_bits(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab_size)), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab_size, generator=generator)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    allowed = _reference_allowed(bitmask, vocab_size)
    assert torch.equal(masked[allowed], logits[allowed])
    assert bool(torch.isneginf(masked[~allowed]).all())


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    compiler = GrammarCompiler(tiny_model_dir / "tokenizer.json", config["vocab_size"], [config["eos_token_id"]])
    yield compiler
    compiler.shutdown()


def test_grammar_masks_fill_static_rows_with_llguidance_masks(compiler):
    """The CPU path of the CUDA-graph buffers: rows land at fixed addresses, free rows allow everything, and a
    smaller later step leaves no stale row behind."""
    vocab = compiler.vocab_size
    masks = GrammarMasks(max_rows=4, vocab_size=vocab, device=CPU)
    digits = compiler.submit('start: /[0-9]+/ "!"')
    words = compiler.submit('start: "yes" | "no"')
    first = masks.fill([digits, None, words])
    address = masks.device_buffer.data_ptr()
    for row, grammar in ((0, digits), (2, words)):
        expected = llguidance.LLMatcher(compiler.tokenizer(), grammar.text).compute_bitmask()
        assert bytes(first[row].numpy().tobytes()) == expected
    assert bool((first[1] == -1).all())
    digits_mask = first[0].clone()
    second = masks.fill([None, digits])
    assert masks.device_buffer.data_ptr() == address and first.data_ptr() == second.data_ptr()
    assert bool((second[0] == -1).all())
    assert torch.equal(second[1], digits_mask)


def test_a_grammar_that_does_not_compile_is_refused_with_llguidance_message(compiler):
    grammar = compiler.submit("start: undefined_rule")
    with pytest.raises(InvalidRequestError, match=r"the grammar does not compile:.*undefined_rule"):
        grammar.matcher  # noqa: B018


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (SamplingParams(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
        (SamplingParams(frequency_penalty=math.nan), r"frequency_penalty must be in \[-2, 2\], got nan"),
        (SamplingParams(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 2\]"),
        (SamplingParams(logit_bias=((VOCAB, 1.0),)), rf"logit_bias token ids \[{VOCAB}\] are outside the vocabulary"),
        (SamplingParams(logit_bias=((3, 100.5),)), r"logit_bias values must be in \[-100, 100\]; token 3 has 100.5"),
        (SamplingParams(logit_bias=((3, math.nan),)), r"token 3 has nan"),
        (SamplingParams(prompt_logprobs=21), r"prompt_logprobs must be in \[0, 20\]"),
        (SamplingParams(grammar="  "), "grammar is empty"),
    ],
)
def test_out_of_range_controls_are_refused_by_name(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        params.validate(VOCAB)


def test_edge_values_are_accepted():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                   logit_bias=((0, -100.0), (VOCAB - 1, 100.0)), prompt_logprobs=0).validate(VOCAB)  # fmt: skip
