"""Token sampling on the device for a batch of requests, one row of logits each.

Per row: greedy (temperature 0) or temperature, then top-k, top-p and min-p filtering, then an
exponential race (argmax of ``p / q`` with ``q ~ Exp(1)``, equivalent to drawing from ``p``).  A
request with a seed draws its noise from its own generator, so its tokens do not depend on which
other requests share the batch.  Until a request has ``min_new_tokens`` tokens its EOS and stop ids
are masked out.

Reported logprobs are those of the model's own distribution (``log_softmax`` of the raw logits),
before temperature and filtering, as OpenAI-compatible servers report them.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3stack.engine.runtime.request import Request, SampledToken


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors (built once per step from the requests)."""

    greedy: torch.Tensor  # [n] bool
    all_greedy: bool
    temperature: torch.Tensor  # [n] float32, 1 on greedy rows
    top_k: torch.Tensor | None  # [n] int64, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    generators: dict[int, torch.Generator]  # row -> the request's own RNG
    banned_rows: torch.Tensor | None  # [m] int64 and
    banned_tokens: torch.Tensor | None  # [m] int64: (row, token) pairs masked out (min_new_tokens)
    num_top_logprobs: list[int]  # per row; 0 = none
    wants_logprobs: list[bool]


def build_sampling_batch(requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
    greedy, temperature, top_k, top_p, min_p = [], [], [], [], []
    generators: dict[int, torch.Generator] = {}
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling
        greedy.append(params.greedy)
        temperature.append(1.0 if params.greedy else params.temperature)
        top_k.append(params.top_k if 0 < params.top_k < vocab_size else vocab_size)
        top_p.append(params.top_p)
        min_p.append(params.min_p)
        if params.seed is not None and not params.greedy:
            if request.generator is None:
                request.generator = torch.Generator(device=device).manual_seed(params.seed)
            generators[row] = request.generator
        if request.num_output_tokens < params.min_new_tokens:
            stops = sorted(request.eos_token_ids | params.stop_token_ids)
            banned_rows += [row] * len(stops)
            banned_tokens += stops

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    needs_top_k = any(k < vocab_size for k, g in zip(top_k, greedy, strict=True) if not g)
    needs_top_p = any(p < 1.0 for p, g in zip(top_p, greedy, strict=True) if not g)
    needs_min_p = any(p > 0.0 for p, g in zip(min_p, greedy, strict=True) if not g)
    return SamplingBatch(
        greedy=tensor(greedy, torch.bool),
        all_greedy=all(greedy),
        temperature=tensor(temperature, torch.float32),
        top_k=tensor(top_k, torch.int64) if needs_top_k else None,
        top_p=tensor(top_p, torch.float32) if needs_top_p else None,
        min_p=tensor(min_p, torch.float32) if needs_min_p else None,
        generators=generators,
        banned_rows=tensor(banned_rows, torch.int64) if banned_rows else None,
        banned_tokens=tensor(banned_tokens, torch.int64) if banned_tokens else None,
        num_top_logprobs=[r.sampling.top_logprobs for r in requests],
        wants_logprobs=[r.sampling.wants_logprobs for r in requests],
    )


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (one descending sort serves both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before > top_p[:, None]  # the most likely token always survives (mass before it is 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _random_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    logits = logits / batch.temperature[:, None]
    if batch.top_k is not None or batch.top_p is not None:
        logits = _filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in batch.generators.items():
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


@dataclass
class DeviceSample:
    """A step's sampling results still on the device (``to_host`` synchronizes)."""

    token_ids: torch.Tensor  # [n] int64
    chosen_logprobs: torch.Tensor | None  # [n]
    top_logprobs: torch.Tensor | None  # [n, k]
    top_ids: torch.Tensor | None  # [n, k]

    def to_host(self, batch: SamplingBatch) -> list[SampledToken]:
        results = [SampledToken(token_id=t) for t in self.token_ids.tolist()]
        if self.chosen_logprobs is None:
            return results
        chosen = self.chosen_logprobs.tolist()
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else []
        top_ids = self.top_ids.tolist() if self.top_ids is not None else []
        for row, result in enumerate(results):
            if not batch.wants_logprobs[row]:
                continue
            result.logprob = chosen[row]
            count = batch.num_top_logprobs[row]
            if count:
                result.top_token_ids = top_ids[row][:count]
                result.top_logprobs = top_values[row][:count]
        return results


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
    """Launch the sampling of one token per row of ``logits`` ([n, V] float32) without waiting for it."""
    logprobs = None
    if any(batch.wants_logprobs):
        logprobs = logits.log_softmax(dim=-1)
    if batch.banned_rows is not None:
        logits = logits.clone()
        logits[batch.banned_rows, batch.banned_tokens] = float("-inf")
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        token_ids = torch.where(batch.greedy, token_ids, _random_sample(logits, batch))
    if logprobs is None:
        return DeviceSample(token_ids, None, None, None)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    max_top = max(batch.num_top_logprobs)
    if not max_top:
        return DeviceSample(token_ids, chosen, None, None)
    values, ids = logprobs.topk(max_top, dim=-1)
    return DeviceSample(token_ids, chosen, values, ids)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ([n, V] float32); returns host-side results."""
    return sample_on_device(logits, batch).to_host(batch)
