"""Presence, frequency and repetition penalties and logit bias, applied to a step's logits on the device.

Semantics (the ones clients of the reference stacks expect):

- presence / frequency (OpenAI): over the tokens generated so far,
  ``logit -= presence * (count > 0) + frequency * count``;
- repetition (HF transformers / vLLM): over the prompt and the generated tokens, a positive logit is divided by
  the penalty and a negative one multiplied by it;
- logit bias (OpenAI): added to the chosen tokens' logits, after the penalties.

The counts live on the device (``TokenCounts``): a slot per live request that uses a penalty, holding its
generated-token counts and its prompt's tokens, and the sampler adds each step's sampled token to its row right
after sampling it.  So a step launched before the previous step's tokens reached the host (async scheduling)
still penalizes them, and nothing per step crosses to the device but the slot index and the penalty values of
each row.  The arithmetic (``apply_penalties``, ``apply_logit_bias``) reads fixed-shape tensors only and never
waits for the host, so it can run inside a CUDA graph.
"""

import logging
from collections.abc import Sequence

import torch

from m3stack.engine.host_copy import upload
from m3stack.engine.runtime.request import Request, RequestStatus

logger = logging.getLogger(__name__)

SCRATCH_SLOT = 0  # rows without penalties read (and never change) this all-zero slot


class TokenCounts:
    """Per-request token statistics on the device: ``counts[slot, t]`` generated tokens, ``in_prompt[slot, t]``.

    Allocated on first use (a deployment that never sees a penalty pays nothing): ``max_requests + 1`` rows of
    ``V`` int32 counts and ``V`` bools, about 64 MB at M3's vocabulary for 64 requests.  A slot is taken when a
    request with a penalty first samples and given back once the request has ended; all updates are on the
    device's stream, in order, so a freed slot's reuse never races with a step still in flight.
    """

    def __init__(self, max_requests: int, vocab_size: int, device: torch.device) -> None:
        self.max_requests = max_requests
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._free: list[int] = list(range(max_requests, SCRATCH_SLOT, -1))
        self._slots: dict[str, tuple[Request, int]] = {}

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    def slots_for(self, requests: Sequence[Request]) -> list[int]:
        """Each request's slot (taken now if it has none; ``SCRATCH_SLOT`` for requests without penalties)."""
        self._release_ended()
        return [self._slot(request) if request.sampling.uses_penalties else SCRATCH_SLOT for request in requests]

    def _slot(self, request: Request) -> int:
        held = self._slots.get(request.request_id)
        if held is not None and held[0] is request:
            return held[1]
        if self.counts is None or self.in_prompt is None:
            rows = self.max_requests + 1
            self.counts = torch.zeros((rows, self.vocab_size), dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        if not self._free:
            self._evict_waiting()
        slot = self._free.pop()
        self._slots[request.request_id] = (request, slot)
        prompt = upload(torch.tensor(request.token_ids[: request.num_prompt_tokens], dtype=torch.int64), self.device)
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, prompt] = True
        self.counts[slot].zero_()
        generated = request.output_token_ids  # known tokens only: a resumed request may have some
        if generated:
            ids = upload(torch.tensor(generated, dtype=torch.int64), self.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def _evict_waiting(self) -> None:
        """Free the slot of a preempted request (more penalized requests are live than run at once); its row is
        rebuilt from its known tokens when it samples again.  Updates already queued on the stream for it run
        before the new owner's reset, so they cannot leak into the new owner's row."""
        for request_id, (request, slot) in self._slots.items():
            if request.status is RequestStatus.WAITING and not request.num_pending_tokens:
                del self._slots[request_id]
                self._free.append(slot)
                return
        raise RuntimeError(f"more than {self.max_requests} running requests use penalties")

    def _release_ended(self) -> None:
        ended = [request_id for request_id, (request, _) in self._slots.items() if request.is_finished]
        for request_id in ended:
            self._free.append(self._slots.pop(request_id)[1])

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count each row's sampled token in its slot (rows on ``SCRATCH_SLOT`` add nothing)."""
        assert self.counts is not None
        real = (slots != SCRATCH_SLOT).to(torch.int32)
        self.counts.index_put_((slots, token_ids), real, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized ``logits`` [n, V] from each row's ``counts`` [n, V] int32 and ``in_prompt`` [n, V] bool, and the
    per-row ``presence``, ``frequency``, ``repetition`` [n] (neutral: 0, 0, 1)."""
    generated = counts > 0
    seen = in_prompt | generated
    scale = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / scale, logits * scale), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> None:
    """Add ``bias[i]`` to ``logits[rows[i], token_ids[i]]`` in place."""
    logits.index_put_((rows, token_ids), bias, accumulate=True)
