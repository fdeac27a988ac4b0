"""Token sampling on the device for a batch of requests, one row of logits each.

Per row, the logits first go through the request's controls: repetition, frequency and presence penalties and
logit bias (``penalties.py``), then until a request has ``min_new_tokens`` tokens its EOS and stop ids are masked
out, then its grammar's token mask (``grammar.py``).  Then greedy (temperature 0) or temperature, top-k, top-p and
min-p filtering, and an exponential race (argmax of ``p / q`` with ``q ~ Exp(1)``, equivalent to drawing from
``p``).  A request with a seed draws its noise from its own generator, so its tokens do not depend on which other
requests share the batch.  Rows without controls go through every control step unchanged, so a batch that mixes
constrained and free requests samples the free ones exactly as a batch of free requests would.

Reported logprobs are those of the model's own distribution (``log_softmax`` of the raw logits),
before temperature and filtering, as OpenAI-compatible servers report them.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.runtime.grammar import RequestGrammar, apply_bitmask
from m3stack.engine.runtime.penalties import TokenCounts, apply_logit_bias, apply_penalties
from m3stack.engine.runtime.request import Request, SampledToken


@dataclass
class LogitControls:
    """A step's per-row logit changes before sampling; a part that no row uses is None."""

    counts: TokenCounts | None = None
    penalty_slots: torch.Tensor | None = None  # [n] int64 slot of each row in ``counts``
    presence: torch.Tensor | None = None  # [n] float32
    frequency: torch.Tensor | None = None  # [n] float32
    repetition: torch.Tensor | None = None  # [n] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values)
    grammars: list[RequestGrammar | None] | None = None  # per row, when any row has a grammar
    bitmask: torch.Tensor | None = None  # [n, ceil(V / 32)] int32 on the device, set once the masks are built

    @property
    def needs_masks(self) -> bool:
        """Sampling must wait for the grammar masks (built after the previous step's tokens are applied)."""
        return self.grammars is not None and self.bitmask is None


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors (built once per step from the requests).

    An all-greedy batch carries no per-row tensors: argmax needs none.
    """

    all_greedy: bool
    greedy: torch.Tensor | None  # [n] bool
    temperature: torch.Tensor | None  # [n] float32, 1 on greedy rows
    top_k: torch.Tensor | None  # [n] int64, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    generators: dict[int, torch.Generator]  # row -> the request's own RNG
    banned_rows: torch.Tensor | None  # [m] int64 and
    banned_tokens: torch.Tensor | None  # [m] int64: (row, token) pairs masked out (min_new_tokens)
    num_top_logprobs: list[int]  # per row; 0 = none
    wants_logprobs: list[bool]
    controls: LogitControls | None = None


def build_controls(requests: Sequence[Request], counts: TokenCounts, device: torch.device) -> LogitControls | None:
    """The step's ``LogitControls``, or None when no row has any (the common case costs one pass over the rows)."""
    params = [request.sampling for request in requests]
    penalized = any(p.uses_penalties for p in params)
    biased = any(p.logit_bias for p in params)
    constrained = any(request.grammar is not None for request in requests)
    if not (penalized or biased or constrained):
        return None
    controls = LogitControls()
    if penalized:
        controls.counts = counts
        controls.penalty_slots = _tensor(counts.slots_for(requests), torch.int64, device)
        controls.presence = _tensor([p.presence_penalty for p in params], torch.float32, device)
        controls.frequency = _tensor([p.frequency_penalty for p in params], torch.float32, device)
        controls.repetition = _tensor([p.repetition_penalty for p in params], torch.float32, device)
    if biased:
        rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
        token_ids = [token for p in params for token, _ in p.logit_bias]
        values = [bias for p in params for _, bias in p.logit_bias]
        controls.bias = (
            _tensor(rows, torch.int64, device),
            _tensor(token_ids, torch.int64, device),
            _tensor(values, torch.float32, device),
        )
    if constrained:
        controls.grammars = [request.grammar for request in requests]
    return controls


def _apply_controls(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits sampling draws from: ``logits`` itself when nothing applies, else a changed copy."""
    controls = batch.controls
    if controls is None and batch.banned_rows is None:
        return logits
    logits = logits.clone()  # the forward's logits may be a CUDA graph's output buffer, and feed the logprobs
    if controls is not None and controls.penalty_slots is not None:
        counts = controls.counts
        assert counts is not None and counts.counts is not None and counts.in_prompt is not None
        assert controls.presence is not None and controls.frequency is not None and controls.repetition is not None
        slots = controls.penalty_slots
        logits = apply_penalties(
            logits,
            counts.counts.index_select(0, slots),
            counts.in_prompt.index_select(0, slots),
            controls.presence,
            controls.frequency,
            controls.repetition,
        )
    if controls is not None and controls.bias is not None:
        apply_logit_bias(logits, *controls.bias)
    if batch.banned_rows is not None:
        logits[batch.banned_rows, batch.banned_tokens] = float("-inf")
    if controls is not None and controls.grammars is not None:
        if controls.bitmask is None:
            raise RuntimeError("a step with grammar rows was sampled before its masks were built")
        apply_bitmask(logits, controls.bitmask)
    return logits


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)


def build_sampling_batch(
    requests: Sequence[Request], vocab_size: int, device: torch.device, counts: TokenCounts | None = None
) -> SamplingBatch:
    """``counts`` holds the penalized requests' token counts on the device (one per runner: they persist across
    steps); without it a batch with penalties gets a fresh one, which only suits a single step (tests)."""
    params = [request.sampling for request in requests]
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for row, request in enumerate(requests):
        # num_output_tokens counts the placeholder being sampled: the tokens before it are one fewer.
        if request.num_output_tokens - 1 < params[row].min_new_tokens:
            stops = sorted(request.eos_token_ids | params[row].stop_token_ids)
            banned_rows += [row] * len(stops)
            banned_tokens += stops
    common = {
        "banned_rows": _tensor(banned_rows, torch.int64, device) if banned_rows else None,
        "banned_tokens": _tensor(banned_tokens, torch.int64, device) if banned_tokens else None,
        "num_top_logprobs": [p.top_logprobs for p in params],
        "wants_logprobs": [p.wants_logprobs for p in params],
        "controls": build_controls(requests, counts or TokenCounts(len(requests), vocab_size, device), device),
    }
    if all(p.greedy for p in params):
        return SamplingBatch(True, None, None, None, None, None, {}, **common)

    generators: dict[int, torch.Generator] = {}
    for row, request in enumerate(requests):
        if params[row].seed is not None and not params[row].greedy:
            if request.generator is None:
                request.generator = torch.Generator(device=device).manual_seed(params[row].seed)
            generators[row] = request.generator
    random_rows = [p for p in params if not p.greedy]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    return SamplingBatch(
        all_greedy=False,
        greedy=_tensor([p.greedy for p in params], torch.bool, device),
        temperature=_tensor([1.0 if p.greedy else p.temperature for p in params], torch.float32, device),
        top_k=_tensor(top_k, torch.int64, device) if any(0 < p.top_k < vocab_size for p in random_rows) else None,
        top_p=_tensor([p.top_p for p in params], torch.float32, device)
        if any(p.top_p < 1.0 for p in random_rows)
        else None,
        min_p=_tensor([p.min_p for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in random_rows)
        else None,
        generators=generators,
        **common,
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
    """A step's sampling results still on the device (``to_host`` synchronizes).

    ``start_copy`` enqueues the copy of the results to pinned host memory right after the sampling and
    records an event; ``to_host`` then waits for that event only.  A plain ``.tolist()`` of a CUDA tensor
    synchronizes the whole stream, i.e. also waits for the next step's forward that async scheduling
    has already enqueued behind this one, and the host would then prepare every step on an idle GPU.
    """

    token_ids: torch.Tensor  # [n] int64
    chosen_logprobs: torch.Tensor | None  # [n]
    top_logprobs: torch.Tensor | None  # [n, k]
    top_ids: torch.Tensor | None  # [n, k]
    _on_host: tuple[torch.Tensor | None, ...] | None = field(default=None, init=False, repr=False)
    _copied: torch.cuda.Event | None = field(default=None, init=False, repr=False)

    def start_copy(self) -> None:
        """Enqueue the device-to-host copy of the results (CUDA; on other devices ``to_host`` reads them directly)."""
        if not self.token_ids.is_cuda:
            return
        tensors = (self.token_ids, self.chosen_logprobs, self.top_logprobs, self.top_ids)
        # non_blocking into CPU gives pinned destinations, so the copies are asynchronous.
        self._on_host = tuple(t.to("cpu", non_blocking=True) if t is not None else None for t in tensors)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_host(self, batch: SamplingBatch) -> list[SampledToken]:
        tensors = (self.token_ids, self.chosen_logprobs, self.top_logprobs, self.top_ids)
        if self._copied is not None and self._on_host is not None:
            self._copied.synchronize()
            tensors = self._on_host
        token_ids, chosen_logprobs, top_logprobs, top_ids = tensors
        assert token_ids is not None
        results = [SampledToken(token_id=t) for t in token_ids.tolist()]
        if chosen_logprobs is None:
            return results
        chosen = chosen_logprobs.tolist()
        top_values = top_logprobs.tolist() if top_logprobs is not None else []
        top_id_rows = top_ids.tolist() if top_ids is not None else []
        for row, result in enumerate(results):
            if not batch.wants_logprobs[row]:
                continue
            result.logprob = chosen[row]
            count = batch.num_top_logprobs[row]
            if count:
                result.top_token_ids = top_id_rows[row][:count]
                result.top_logprobs = top_values[row][:count]
        return results


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
    """Launch the sampling of one token per row of ``logits`` ([n, V] float32) without waiting for it."""
    logprobs = None
    if any(batch.wants_logprobs):
        logprobs = logits.log_softmax(dim=-1)
    logits = _apply_controls(logits, batch)
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        token_ids = torch.where(batch.greedy, token_ids, _random_sample(logits, batch))
    controls = batch.controls
    if controls is not None and controls.counts is not None and controls.penalty_slots is not None:
        controls.counts.record(controls.penalty_slots, token_ids)
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
