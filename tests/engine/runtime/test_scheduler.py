"""Scheduler: token budget, chunked prefill, admission, longest-prefix-first, preemption, stops, encoder steps.

The scheduler is driven directly: each step's "sampled" token is chosen by the test, and the pool
and queue invariants are checked after every step.
"""

import random
import time

import pytest
import torch

from m3stack.engine.kv_cache.manager import KVCacheManager
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.errors import QueueFullError
from m3stack.engine.runtime.request import FinishReason, RequestStatus, SampledToken, SamplingParams
from m3stack.engine.runtime.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def make_scheduler(num_blocks=64, encoder_capacity=64, **config) -> Scheduler:
    settings = {"max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 16, **config}
    return Scheduler(SchedulerConfig(**settings), KVCacheManager(num_blocks, BLOCK), EncoderCache(encoder_capacity))


def step(scheduler: Scheduler, token=lambda request: 5):
    out = scheduler.schedule()
    sampled = {s.request.request_id: SampledToken(token(s.request)) for s in out.requests if s.samples}
    outputs = scheduler.update(out, sampled)
    scheduler.check_invariants()
    return out, {o.request_id: o for o in outputs}


def run_until_idle(scheduler: Scheduler, max_steps=500, token=lambda request: 5) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_work:
            return finished
        _, outputs = step(scheduler, token)
        finished.update({rid: o for rid, o in outputs.items() if o.finished})
    raise AssertionError("scheduler did not drain")


def test_one_budget_mixes_decodes_with_a_prefill_chunk(new_request):
    scheduler = make_scheduler()
    a, b = new_request([1, 2, 3]), new_request([4, 5])
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # both prefill whole and sample
    long = new_request(list(range(40)))
    scheduler.add_request(long)
    out, _ = step(scheduler)
    shares = {s.request.request_id: s.num_new_tokens for s in out.requests}
    assert shares == {a.request_id: 1, b.request_id: 1, long.request_id: 14}
    assert out.num_tokens == 16


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(new_request):
    scheduler = make_scheduler()
    request = new_request(list(range(50)))
    scheduler.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        out, _ = step(scheduler)
        (share,) = out.requests
        chunks.append((share.start, share.num_new_tokens, share.samples))
        assert request.status is (RequestStatus.DECODING if share.samples else RequestStatus.PREFILLING)
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]


def test_running_requests_are_capped_by_max_num_seqs(new_request):
    scheduler = make_scheduler(max_num_seqs=2)
    for _ in range(3):
        scheduler.add_request(new_request([1, 2]))
    step(scheduler)
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_longest_cached_prefix_goes_first_until_a_request_has_waited_too_long(new_request):
    for fcfs_after_s, expect_hit_first in ((60.0, True), (0.0, False)):
        scheduler = make_scheduler(max_num_seqs=1, fcfs_after_s=fcfs_after_s)
        warm = new_request(list(range(12)), max_tokens=1)
        scheduler.add_request(warm)
        run_until_idle(scheduler)
        now = time.monotonic()
        cold = new_request([50 + i for i in range(12)], max_tokens=1, arrival_time=now - 0.2)
        hit = new_request([*range(12), 77], max_tokens=1, arrival_time=now - 0.1)
        scheduler.add_request(cold)
        scheduler.add_request(hit)
        out, _ = step(scheduler)
        (admitted,) = out.requests
        assert (admitted.request is hit) is expect_hit_first
        if expect_hit_first:
            assert admitted.start == 12 and hit.num_cached_tokens == 12


def test_lower_priority_value_is_admitted_first(new_request):
    scheduler = make_scheduler(max_num_seqs=1)
    late_urgent = new_request([1, 2], priority=-1, arrival_time=5.0)
    early = new_request([3, 4], priority=0, arrival_time=1.0)
    scheduler.add_request(early)
    scheduler.add_request(late_urgent)
    out, _ = step(scheduler)
    assert [s.request for s in out.requests] == [late_urgent]


def test_admission_needs_room_for_the_whole_prompt_not_just_the_first_chunk(new_request):
    scheduler = make_scheduler(num_blocks=9)  # 8 usable blocks = 32 tokens
    holder = new_request(list(range(12)), max_tokens=30)  # 3 blocks + 1 of growth reserved
    scheduler.add_request(holder)
    step(scheduler)
    big = new_request(list(range(100, 120)))  # 5 blocks; its first 15-token chunk alone would fit
    scheduler.add_request(big)
    out, _ = step(scheduler)
    assert big not in [s.request for s in out.requests] and big.status is RequestStatus.WAITING
    scheduler.abort_request(holder.request_id, "test")
    out, _ = step(scheduler)
    assert [s.request for s in out.requests] == [big]


def test_preemption_by_recompute_keeps_generated_tokens_and_blocks_admission(new_request):
    def counting(request):
        return 10 + request.num_generated_tokens

    scheduler = make_scheduler(num_blocks=7, max_model_len=32)  # 6 usable blocks
    first = new_request(list(range(8)), max_tokens=12)
    second = new_request(list(range(20, 28)), max_tokens=12)
    scheduler.add_request(first)
    step(scheduler, counting)
    scheduler.add_request(second)
    step(scheduler, counting)
    assert scheduler.num_running == 2
    tokens_at_preemption = None
    for _ in range(20):
        late = new_request([9, 9], max_tokens=1)
        scheduler.add_request(late)
        out, _ = step(scheduler, counting)
        if out.preempted_ids:
            tokens_at_preemption = list(second.output_token_ids)
            assert out.preempted_ids == [second.request_id]  # the newer one
            assert all(s.request is not late for s in out.requests), "admitted during a preemption step"
            break
        scheduler.abort_request(late.request_id, "not part of this test")
    assert tokens_at_preemption is not None, "the pool never ran out"
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    scheduler.abort_request(late.request_id, "not part of this test")
    finished = run_until_idle(scheduler, token=counting)
    assert second.output_token_ids[: len(tokens_at_preemption)] == tokens_at_preemption
    assert second.output_token_ids == [10 + i for i in range(12)]
    assert finished[second.request_id].finish_reason is FinishReason.LENGTH
    assert second.num_preemptions >= 1
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_usable_blocks


def test_a_full_queue_refuses_new_requests(new_request):
    scheduler = make_scheduler(max_waiting=2)
    scheduler.add_request(new_request([1]))
    scheduler.add_request(new_request([2]))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        scheduler.add_request(new_request([3]))


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_frees_every_block_at_any_stage(new_request, when):
    scheduler = make_scheduler()
    request = new_request(list(range(30)))
    scheduler.add_request(request)
    if when != "waiting":
        step(scheduler)
    if when == "decoding":
        step(scheduler)
        assert request.status is RequestStatus.DECODING
    output = scheduler.abort_request(request.request_id, "client went away")
    assert output.finish_reason is FinishReason.ABORT and output.abort_message == "client went away"
    assert request.status is RequestStatus.ABORTED
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_usable_blocks
    assert scheduler.abort_request(request.request_id, "again") is None
    scheduler.check_invariants()


def test_stop_conditions(new_request):
    eos = frozenset({0})
    cases = [
        # (sampling, tokens the model produces, expected emitted tokens, reason, matched stop)
        (SamplingParams(temperature=0), [3, 0, 4], [3], FinishReason.STOP, 0),
        (SamplingParams(temperature=0, stop_token_ids=frozenset({9})), [3, 9], [3], FinishReason.STOP, 9),
        (SamplingParams(temperature=0, min_new_tokens=2), [0, 3, 0], [0, 3], FinishReason.STOP, 0),
        (SamplingParams(temperature=0, ignore_eos=True), [0, 0, 0, 0], [0, 0, 0, 0], FinishReason.LENGTH, None),
        (SamplingParams(temperature=0), [3, 3, 3, 3, 3], [3, 3, 3, 3], FinishReason.LENGTH, None),
    ]
    for sampling, produced, emitted, reason, stop in cases:
        scheduler = make_scheduler()
        request = new_request([1, 2], sampling=sampling, eos=eos, max_tokens=4)
        scheduler.add_request(request)
        seen, final = [], None
        for token in produced:
            _, outputs = step(scheduler, token=lambda r, t=token: t)
            seen += outputs[request.request_id].new_token_ids
            if outputs[request.request_id].finished:
                final = outputs[request.request_id]
                break
        assert seen == emitted, sampling
        assert final is not None and final.finish_reason is reason and final.stop_token_id == stop, sampling
        assert final.num_output_tokens == len(produced[: len(seen) + (stop is not None)])


def test_the_context_limit_ends_generation(new_request):
    scheduler = make_scheduler(max_model_len=10)
    request = new_request(list(range(8)), max_tokens=100)
    scheduler.add_request(request)
    finished = run_until_idle(scheduler)
    assert finished[request.request_id].finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 10


def test_the_encoder_runs_once_per_content_and_chunks_read_its_cache(new_request, new_image):
    scheduler = make_scheduler(max_num_batched_tokens=8, max_encoder_embeds_per_step=64)
    first = new_request(list(range(20)), mm_inputs=[new_image("img", range(10, 16))])
    scheduler.add_request(first)
    out, _ = step(scheduler)  # chunk [0, 8) does not reach the image
    assert out.encoder_items == [] and first.status is RequestStatus.PREFILLING
    out = scheduler.schedule()  # chunk [8, 16) needs it
    assert [i.content_hash for i in out.encoder_items] == ["img"] and first.status is RequestStatus.ENCODING
    scheduler.encoder_cache.put("img", torch.zeros(6, 2))  # what the runner's encoder step does
    scheduler.update(out, {})
    out = scheduler.schedule()  # chunk [16, 20): text only, from the cache
    assert out.encoder_items == [] and first.status is RequestStatus.PREFILLING
    scheduler.update(out, {first.request_id: SampledToken(1)})
    assert first.status is RequestStatus.DECODING
    second = new_request([*range(5), 99], mm_inputs=[new_image("img", range(0, 6))], max_tokens=1)
    scheduler.add_request(second)
    out, _ = step(scheduler)
    assert out.encoder_items == [] and second in [s.request for s in out.requests]
    assert scheduler.encoder_cache.hits >= 1


def test_a_chunk_stops_before_an_item_the_encoder_cache_cannot_hold_yet(new_request, new_image):
    scheduler = make_scheduler(max_num_batched_tokens=32, encoder_capacity=8)
    holder = new_request(list(range(40)), mm_inputs=[new_image("a", range(30, 38))])
    scheduler.add_request(holder)
    step(scheduler)  # [0, 32): reserves "a" (8 embeds) -> the cache is full and pinned
    other = new_request(list(range(100, 120)), mm_inputs=[new_image("b", range(6, 10))])
    scheduler.add_request(other)
    out, _ = step(scheduler)
    share = next(s for s in out.requests if s.request is other)
    assert share.num_new_tokens == 6 and "b" not in [i.content_hash for i in out.encoder_items]


def test_random_traffic_keeps_invariants_and_drains(new_request):
    rng = random.Random(7)
    scheduler = make_scheduler(num_blocks=24, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=20)
    prefixes = [[rng.randrange(500) for _ in range(12)] for _ in range(3)]
    live, done = [], 0
    for tick in range(400):
        if tick < 250 and rng.random() < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + [
                rng.randrange(500) for _ in range(rng.randrange(8))
            ]
            request = new_request(prompt, max_tokens=rng.randrange(1, 16), priority=rng.choice([0, 0, 1]))
            scheduler.add_request(request)
            live.append(request)
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            scheduler.abort_request(victim.request_id, "random abort")
        _, outputs = step(scheduler, token=lambda r: rng.randrange(1, 500))
        done += sum(o.finished for o in outputs.values())
        live = [r for r in live if not r.is_finished]
    assert not scheduler.has_work, f"{scheduler.num_running} running, {scheduler.num_waiting} waiting"
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_usable_blocks
    assert done > 50
    assert scheduler.num_preemptions < done  # the guard: no request is preempted over and over


def test_the_thrash_guard_preempts_no_request_twice_under_sustained_pressure(new_request):
    # 8 requests whose outputs need 4x their prompt's KV, in a pool that holds half of the final total.
    scheduler = make_scheduler(num_blocks=17, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64)
    requests = [new_request([i * 10 + j for j in range(8)], max_tokens=24) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    finished = run_until_idle(scheduler, token=lambda r: 7)
    assert len(finished) == 8 and all(len(r.output_token_ids) == 24 for r in requests)
    assert scheduler.num_preemptions > 0, "the scenario no longer creates pressure"
    # Without the whole-context admission rule and the no-admission-while-preempting rule, the newest
    # requests are admitted and preempted again and again (3 times here).
    assert max(r.num_preemptions for r in requests) <= 1


def _token_at(request, position: int) -> int:
    """A token that depends only on the request and the position it is sampled for (0 is EOS now and then)."""
    return (hash((request.request_id, position)) % 97) * (position % 13 != 7)


def _drive(scheduler: Scheduler, arrivals: dict[int, list], aborts: dict[int, list[str]], pipelined: bool) -> dict:
    """Run to completion; with ``pipelined`` step N+1 is scheduled before step N is applied (async scheduling)."""
    results, in_flight, tick = {}, None, 0
    while tick in arrivals or tick <= max(arrivals) or scheduler.has_work or in_flight:
        for request in arrivals.get(tick, []):
            scheduler.add_request(request)
        for request_id in aborts.get(tick, []):
            scheduler.abort_request(request_id, "test")
        out = scheduler.schedule()
        sampled = {s.request.request_id: SampledToken(_token_at(s.request, s.start + s.num_new_tokens))
                   for s in out.requests if s.samples}  # fmt: skip
        if pipelined:
            applied, in_flight = in_flight, ((out, sampled) if out.requests else None)
        else:
            applied = (out, sampled)
        if applied is not None:
            for output in scheduler.update(*applied):
                entry = results.setdefault(output.request_id, [[], None])
                entry[0] += output.new_token_ids
                if output.finished:
                    entry[1] = (output.finish_reason, output.stop_token_id, output.num_output_tokens)
        scheduler.check_invariants()
        tick += 1
        assert tick < 2000, "did not drain"
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_usable_blocks
    return results


def test_pipelined_scheduling_gives_the_same_results_as_step_by_step(new_request):
    def traffic():
        rng = random.Random(11)
        arrivals, aborts = {}, {}
        for index in range(40):
            prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 30))]
            request = new_request(prompt, request_id=f"q{index}", max_tokens=rng.randrange(1, 20), eos=frozenset({0}),
                                  priority=rng.choice([0, 1]))  # fmt: skip
            arrivals.setdefault(rng.randrange(60), []).append(request)
            if index % 9 == 4:
                aborts.setdefault(rng.randrange(60), []).append(request.request_id)
        return arrivals, aborts

    runs = {}
    for pipelined in (False, True):
        scheduler = make_scheduler(num_blocks=40, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=20)
        runs[pipelined] = _drive(scheduler, *traffic(), pipelined=pipelined)
    aborted = {rid for rid, (_, end) in runs[False].items() if end and end[0] is FinishReason.ABORT}
    aborted |= {rid for rid, (_, end) in runs[True].items() if end and end[0] is FinishReason.ABORT}
    completed = set(runs[False]) - aborted
    assert len(completed) > 25
    assert any(runs[False][rid][1][0] is FinishReason.STOP for rid in completed), "no stop token was exercised"
    for rid in completed:
        assert runs[True][rid] == runs[False][rid], rid


def test_a_request_preempted_while_its_step_is_in_flight_keeps_that_token(new_request):
    scheduler = make_scheduler(num_blocks=7, max_model_len=32)  # 6 usable blocks
    first = new_request(list(range(8)), max_tokens=12)
    second = new_request(list(range(20, 28)), max_tokens=12)
    scheduler.add_request(first)
    scheduler.add_request(second)
    in_flight = None
    for _ in range(30):
        out = scheduler.schedule()
        if out.preempted_ids:
            break
        sampled = {s.request.request_id: SampledToken(len(s.request.token_ids)) for s in out.requests if s.samples}
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = (out, sampled)
        scheduler.check_invariants()
    assert out.preempted_ids == [second.request_id]
    # The step in flight samples a token for the request just preempted: it is kept, not recomputed.
    assert second.status is RequestStatus.WAITING and second.num_pending_tokens == 1
    expected = in_flight[1][second.request_id].token_id
    scheduler.update(*in_flight)
    assert second.num_pending_tokens == 0 and second.output_token_ids[-1] == expected
    assert second.num_computed_tokens == 0 and scheduler.kv.num_held_blocks(second.request_id) == 0
    scheduler.check_invariants()
