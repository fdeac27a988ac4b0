"""Continuous batching under one token budget per step (vLLM v1 style).

Each step the scheduler hands out at most ``max_num_batched_tokens`` new tokens: running requests
first (a decode takes one token, an unfinished prompt takes the next chunk), then waiting requests,
longest cached prefix first.  Prefill and decode are the same thing to it, so chunked prefill needs
no special case.  It only decides; ``ModelRunner`` executes and ``update`` applies the results.

KV pressure:
- Admission needs room for the request's *whole* remaining context plus a reserve (one block of
  growth per running request and the unallocated rest of every running prefill), not just the
  first chunk.  Admitting a long prompt chunk by chunk on hope is what makes schedulers thrash.
- When a running request cannot grow, the least important running request that has not advanced
  yet this step (highest ``priority`` value, then newest) is preempted by recompute: its blocks are
  freed (their cached content usually survives for the resume) and it rejoins the waiting queue.
- No request is admitted in a step that preempted one.

Progress is booked when a step is scheduled, not when it ran: ``num_computed_tokens`` advances and
a sampling request gets a placeholder for the token the step will sample.  So the next step can be
scheduled while this one runs on the GPU (async scheduling); ``update`` later fills the
placeholders, publishes the blocks the step wrote and finishes requests.  A request that finishes
on a stop token is discovered one step late there, and its extra step's token is dropped.
"""

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from m3stack.engine.kv_cache.interfaces import KVManager
from m3stack.engine.kv_cache.manager import blocks_for
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.errors import QueueFullError
from m3stack.engine.runtime.request import (
    FinishReason,
    MultimodalInput,
    Request,
    RequestOutput,
    RequestStatus,
    SampledToken,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    # Vision embeddings the encoder may produce per step (an item larger than this still runs alone).
    max_encoder_embeds_per_step: int = 4096
    # Waiting requests considered for longest-prefix-first each step (prefix lookups cost time).
    prefix_order_window: int = 64
    # A request waiting longer than this is admitted in arrival order, whatever its prefix hit.
    fcfs_after_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)`` of ``request.token_ids``."""

    request: Request
    start: int
    num_new_tokens: int
    block_ids: np.ndarray  # the request's page table (int32 block ids) at scheduling time
    # The chunk reaches the request's last token, so the step samples the next one (into a placeholder).
    samples: bool = field(init=False)
    # request.num_preemptions when scheduled: a later preemption makes this step's KV moot.
    epoch: int = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens == self.request.num_tokens
        self.epoch = self.request.num_preemptions


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    # Items the encoder must run before the forward, in order; their outputs go to the encoder cache.
    encoder_items: list[MultimodalInput] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class _StepBudget:
    """What is left to hand out while one step is being scheduled."""

    tokens: int
    encoder_embeds: int
    encoded_any: bool = False
    encode: dict[str, MultimodalInput] = field(default_factory=dict)  # content hash -> item to run


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, encoder_cache: EncoderCache) -> None:
        self.config = config
        self.kv = kv
        self.encoder_cache = encoder_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- queue ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request, *, bypass_queue_limit: bool = False) -> None:
        """Queue a request; ``bypass_queue_limit`` is for the engine's own probes (deep health checks)."""
        if not bypass_queue_limit and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End a live request now and free its blocks; None when the id is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.finish(FinishReason.ABORT)
        self._release(request)
        return _final_output(request, abort_message=message)

    # --- scheduling -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _StepBudget(self.config.max_num_batched_tokens, self.config.max_encoder_embeds_per_step)

        index = 0
        while index < len(self.running) and budget.tokens > 0:
            request = self.running[index]
            if request.num_pending_tokens and self._ends_with_pending_token(request):
                index += 1  # its last token is being sampled; update() finishes it
                continue
            start = request.num_computed_tokens
            num_new = self._fit_encoder(request, start, min(request.num_tokens_to_compute, self._chunk_limit(budget)),
                                        budget)  # fmt: skip
            if num_new == 0:
                index += 1
                continue
            while not self.kv.allocate(request, num_new):
                victim = max(self.running[index:], key=lambda r: (r.priority, r.arrival_time))
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.requests.append(ScheduledRequest(request, start, num_new, self.kv.block_ids(request.request_id)))
                budget.tokens -= num_new
                index += 1

        if not out.preempted_ids:
            self._admit_waiting(out, budget)

        # A reservation dropped by a preemption above leaves no entry: that item is not encoded.
        out.encoder_items = [item for key, item in budget.encode.items() if key in self.encoder_cache]
        for item in out.requests:
            request = item.request
            request.num_computed_tokens = item.start + item.num_new_tokens
            if item.samples:
                request.append_placeholder()
            if budget.encode and any(mm.content_hash in budget.encode for mm in request.mm_inputs):
                request.transition(RequestStatus.ENCODING)
            elif item.start >= request.num_prompt_tokens:
                request.transition(RequestStatus.DECODING)
            else:
                request.transition(RequestStatus.PREFILLING)
        return out

    def _ends_with_pending_token(self, request: Request) -> bool:
        return request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len

    def rewind(self, out: SchedulerOutput, request_ids: set[str]) -> None:
        """Undo the booking of a step that never ran for these requests (they are scheduled again next step)."""
        for item in out.requests:
            request = item.request
            if request.request_id not in request_ids or request.is_finished or request.num_preemptions != item.epoch:
                continue
            request.num_computed_tokens = item.start
            if item.samples:
                request.token_ids.pop()
                request.num_pending_tokens -= 1

    def _admit_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        if not self.waiting:
            return
        reserve = sum(self._growth_blocks(request) for request in self.running)
        for request in self._waiting_order():
            if len(self.running) >= self.config.max_num_seqs or budget.tokens <= 0:
                break
            if request.num_pending_tokens:
                continue  # preempted while a step sampled for it: readmitted once that token is known
            # Looked up again: admitting the previous request may have evicted blocks of this prefix.
            cached_prefix = self.kv.find_cached_prefix(request)
            num_cached = len(cached_prefix) * self.kv.block_size
            whole_context = self.kv.num_new_blocks(request, request.num_tokens - num_cached, cached_prefix)
            if not self.kv.can_admit(whole_context, reserve):
                break  # head of line waits for room: admitting others past it would starve it
            num_new = self._fit_encoder(
                request, num_cached, min(request.num_tokens - num_cached, self._chunk_limit(budget)), budget
            )
            if num_new == 0:
                break
            if not self.kv.allocate(request, num_new, cached_prefix):
                # Only with CPU KV offload: free blocks count host slots, and the device room for this chunk
                # comes from moving blocks of running requests out, which may have to wait for their writes.
                break
            request.num_computed_tokens = num_cached  # the chunk itself is booked at the end of schedule()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached)
            self.waiting.remove(request)
            self.running.append(request)
            out.requests.append(ScheduledRequest(request, num_cached, num_new, self.kv.block_ids(request.request_id)))
            budget.tokens -= num_new
            reserve += self._growth_blocks(request)

    def _chunk_limit(self, budget: _StepBudget) -> int:
        """New tokens a request may take this step: the step's budget, and what the KV manager can place at once
        (with CPU KV offload, less than the device pool)."""
        return min(budget.tokens, self.kv.max_chunk_tokens)

    def _waiting_order(self) -> list[Request]:
        """Priority first; then, among the oldest ``prefix_order_window``, the longest cached prefix."""
        window = sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))[: self.config.prefix_order_window]
        if not self.kv.enable_prefix_caching or len(window) == 1:
            return window
        now = time.monotonic()

        def key(request: Request) -> tuple:
            if now - request.arrival_time > self.config.fcfs_after_s:
                return (request.priority, 0, 0, request.arrival_time)
            return (request.priority, 1, -len(self.kv.find_cached_prefix(request)), request.arrival_time)

        return sorted(window, key=key)

    def _growth_blocks(self, request: Request) -> int:
        """Blocks kept back for a running request: the unallocated rest of its prompt, or one block of growth."""
        needed = blocks_for(request.num_tokens + 1, self.kv.block_size)
        return max(1, needed - self.kv.num_held_blocks(request.request_id))

    def _fit_encoder(self, request: Request, start: int, num_new: int, budget: _StepBudget) -> int:
        """Shorten the chunk ``[start, start + num_new)`` to what the encoder cache can serve this step."""
        if not request.mm_inputs:
            return num_new
        end = start + num_new
        for item in request.mm_inputs:
            if item.last_embed < start:
                continue
            if item.first_embed >= end:
                break
            if self.encoder_cache.acquire(item.content_hash, request.request_id):
                continue
            affordable = item.num_embeds <= budget.encoder_embeds or not budget.encoded_any
            if affordable and self.encoder_cache.reserve(item.content_hash, item.num_embeds, request.request_id):
                budget.encoder_embeds -= item.num_embeds
                budget.encoded_any = True
                budget.encode[item.content_hash] = item
                continue
            end = item.first_embed  # prefill the text before the item now, the item in a later step
            break
        return max(0, end - start)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.transition(RequestStatus.WAITING)
        self.waiting.append(request)
        self.num_preemptions += 1
        logger.info("preempted %s (KV full; %d free blocks)", request, self.kv.num_free_blocks)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        for item in request.mm_inputs:
            self.encoder_cache.release(item.content_hash, request.request_id)
        if request.is_finished:
            self.requests.pop(request.request_id, None)

    # --- results --------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[RequestOutput]:
        """Apply a step that ran: publish the blocks it wrote, fill its placeholders, finish requests.

        Tolerates what happened since the step was scheduled: requests aborted meanwhile are skipped;
        a request preempted meanwhile keeps its sampled token (computed from intact KV) but publishes
        nothing (its blocks are gone).
        """
        outputs = []
        for scheduled in out.requests:
            request = scheduled.request
            if request.is_finished:
                continue
            written = scheduled.start + scheduled.num_new_tokens
            if request.num_preemptions == scheduled.epoch:
                self.kv.publish_computed_blocks(request, written)
                if request.mm_inputs:
                    for item in request.mm_inputs:
                        if item.last_embed < written:
                            self.encoder_cache.release(item.content_hash, request.request_id)
            if scheduled.samples:
                outputs.append(self._apply_token(request, sampled[request.request_id]))
        return outputs

    def _apply_token(self, request: Request, token: SampledToken) -> RequestOutput:
        request.resolve_placeholder(token.token_id)
        if request.status is not RequestStatus.WAITING:
            request.transition(RequestStatus.DECODING)
        reason, stop_token = self._stop_reason(request, token.token_id)
        output = RequestOutput(request.request_id)
        if request.grammar is not None and stop_token is None:
            if not request.grammar.accept(token.token_id):  # the mask allowed it: a bug here or in the grammar engine
                logger.warning("%s: the grammar rejected token %d: %s", request, token.token_id, request.grammar.error)
                reason = FinishReason.ABORT
                output.abort_message = f"the grammar rejected a token: {request.grammar.error}"
            elif request.grammar.complete:
                reason = FinishReason.STOP  # the output is a whole sentence of the grammar: nothing may follow
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            output.prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_sent = True
        if stop_token is None:  # a stop token never reaches the client as text
            output.new_token_ids.append(token.token_id)
            if token.logprob is not None:
                output.new_logprobs.append(token.logprob)
            if token.top_token_ids is not None and token.top_logprobs is not None:
                output.new_top_logprobs.append((token.top_token_ids, token.top_logprobs))
        if reason is not None:
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                self.running.remove(request)
            request.finish(reason, stop_token)
            self._release(request)
            output.finish_reason = reason
            output.stop_token_id = stop_token
        _fill_counts(output, request)
        return output

    def _stop_reason(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        sampling = request.sampling
        generated = request.num_generated_tokens
        stops = token_id in request.eos_token_ids or token_id in sampling.stop_token_ids
        if stops and generated > sampling.min_new_tokens:
            return FinishReason.STOP, token_id
        if generated >= request.max_tokens or request.num_known_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    # --- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """AssertionError when queues, page tables and the pool disagree (used by tests after every step)."""
        self.kv.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "request registry and queues disagree"
        for request in self.waiting:
            assert self.kv.num_held_blocks(request.request_id) == 0, f"waiting {request} holds blocks"
            assert request.status is RequestStatus.WAITING, f"{request} in the waiting queue"
        for request in self.running:
            held = self.kv.num_held_blocks(request.request_id)
            assert held * self.kv.block_size >= request.num_computed_tokens, f"{request} lost KV blocks"


def _fill_counts(output: RequestOutput, request: Request) -> None:
    output.num_prompt_tokens = request.num_prompt_tokens
    output.num_output_tokens = request.num_generated_tokens
    output.num_cached_tokens = request.num_cached_tokens or 0


def _final_output(request: Request, abort_message: str = "") -> RequestOutput:
    output = RequestOutput(request.request_id, finish_reason=request.finish_reason, abort_message=abort_message)
    _fill_counts(output, request)
    return output
