"""Sampler: each filter against an independently computed distribution, seeds, min_new_tokens, logprobs."""

import numpy as np
import pytest
import torch

from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.sampler import build_sampling_batch, sample

VOCAB = 8
ROWS = 8000  # empirical frequencies: standard error <= 0.006


def _sample_many(new_request, params: SamplingParams, logits_row: torch.Tensor, rows: int = ROWS) -> np.ndarray:
    requests = [new_request([1], sampling=params) for _ in range(rows)]
    batch = build_sampling_batch(requests, VOCAB, torch.device("cpu"))
    tokens = [s.token_id for s in sample(logits_row.expand(rows, -1).clone(), batch)]
    return np.bincount(tokens, minlength=VOCAB) / rows


def _reference(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The target distribution, written from the definitions in float64."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.ones(VOCAB, dtype=bool)
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0)
    kept /= kept.sum()
    if top_p < 1.0:
        mass = 0.0
        for token in order:
            if mass > top_p:
                keep[token] = False
            mass += kept[token]
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0)
    return out / out.sum()


@pytest.fixture(scope="module")
def logits_row() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(VOCAB, generator=generator) * 1.5


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 1.7, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 1.2, "top_k": 5, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.2},
    ],
)
def test_sampled_frequencies_match_the_filtered_distribution(new_request, logits_row, settings):
    observed = _sample_many(new_request, SamplingParams(**settings), logits_row)
    expected = _reference(logits_row.numpy(), **settings)
    assert np.all(observed[expected == 0] == 0), f"filtered tokens were sampled: {observed} vs {expected}"
    np.testing.assert_allclose(observed, expected, atol=0.025)


def test_greedy_rows_take_the_argmax_next_to_random_rows(new_request):
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    requests = [new_request([1], sampling=p) for p in params]
    tokens = [s.token_id for s in sample(logits.clone(), build_sampling_batch(requests, VOCAB, torch.device("cpu")))]
    for row in (0, 2, 4):
        assert tokens[row] == int(logits[row].argmax())


def test_a_seed_fixes_the_tokens_whatever_the_batch(new_request):
    logits = torch.randn(1, 1000)

    def draw(seed: int, batch_size: int, row: int, steps: int = 5) -> list[int]:
        target = new_request([1], sampling=SamplingParams(temperature=1.0, seed=seed))
        others = [new_request([1], sampling=SamplingParams(temperature=0.9)) for _ in range(batch_size - 1)]
        tokens = []
        for _ in range(steps):
            requests = [*others[:row], target, *others[row:]]
            batch = build_sampling_batch(requests, 1000, torch.device("cpu"))
            tokens.append(sample(logits.expand(batch_size, -1).clone(), batch)[row].token_id)
        return tokens

    reference = draw(seed=42, batch_size=1, row=0)
    assert draw(seed=42, batch_size=7, row=3) == reference
    assert draw(seed=42, batch_size=4, row=3) == reference
    assert draw(seed=43, batch_size=1, row=0) != reference
    assert len(set(reference)) > 1  # the stream advances between steps


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached(new_request):
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0  # EOS is by far the most likely
    logits[0, 4] = 9.0  # then a stop id
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=frozenset({4}))
    request = new_request([1], sampling=params, eos=frozenset({3}))
    for step in range(3):  # as the scheduler does: a placeholder for the token being sampled
        request.append_placeholder()
        token = sample(logits.clone(), build_sampling_batch([request], VOCAB, torch.device("cpu")))[0].token_id
        assert (token == 3) is (step == 2), (step, token)  # tokens 1 and 2 must not stop, token 3 may
        request.resolve_placeholder(token)


def test_logprobs_and_top_logprobs_are_the_model_distribution(new_request):
    logits = torch.randn(3, VOCAB, dtype=torch.float32)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.7, top_logprobs=5),
        SamplingParams(temperature=0.0),
    ]
    requests = [new_request([1], sampling=p) for p in params]
    results = sample(logits.clone(), build_sampling_batch(requests, VOCAB, torch.device("cpu")))
    reference = logits.double().numpy()
    reference = reference - reference.max(axis=1, keepdims=True)
    reference = reference - np.log(np.exp(reference).sum(axis=1, keepdims=True))
    for row, count in ((0, 3), (1, 5)):
        result = results[row]
        assert result.logprob == pytest.approx(reference[row, result.token_id], abs=1e-5)
        order = np.argsort(-reference[row], kind="stable")[:count]
        assert result.top_token_ids == order.tolist()
        np.testing.assert_allclose(result.top_logprobs, reference[row, order], atol=1e-5)
    assert results[2].logprob is None and results[2].top_token_ids is None
