"""``engine.msa.metrics``: the host-side block counts agree with what the reference selection holds, the monitor
times what its scans bracket, and the GPU backend (Triton interpreted) times both of its indexers in an engine.

The CUDA path's bookkeeping runs here too: which steps are timed (``StepSampler``) and how event pairs are pooled,
bounded and read back once passed (``EventTimings``, over host events that pass when the test says).  The events
themselves, graph capture and streams are tests/gpu/test_msa_metrics.py's.
"""

import time
from dataclasses import astuple

import numpy as np
import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import stop_parallel_engine
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.msa.metrics import EventTimings, MsaMonitor, StepSampler, index_scan, selection_counts
from m3stack.engine.msa.reference import block_scores, index_block_topk
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.engine.runtime.warmup import warm_up


def _reference_counts(query_lens: list[int], seq_lens: list[int], block_size: int, topk: int) -> dict[str, tuple]:
    """(selected, candidate) blocks by phase, read off the reference indexer's output on random index keys:
    valid entries of each token's selection (every head alike), and its blocks with a finite score."""
    generator = torch.Generator().manual_seed(0)
    totals = {"prefill": [0, 0], "decode": [0, 0]}
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        index_q = torch.randn((query_len, 2, 8), generator=generator)
        index_k = torch.randn((seq_len, 8), generator=generator)
        positions = torch.arange(seq_len - query_len, seq_len)
        selected = index_block_topk(index_q, index_k, positions, block_size, topk, local_blocks=1)
        assert ((selected[0] >= 0).sum(-1) == (selected[1] >= 0).sum(-1)).all()
        visible = torch.isfinite(block_scores(index_q, index_k, positions, block_size)[0]).sum(-1)
        phase = totals["decode" if query_len == 1 else "prefill"]
        phase[0] += int((selected[0] >= 0).sum())
        phase[1] += int(visible.sum())
    return {phase: tuple(counts) for phase, counts in totals.items()}


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_size", "topk"),
    [
        ([1], [1], 16, 4),  # the first token: one block, itself
        ([1, 1, 1], [16, 17, 200], 16, 4),  # decode across block edges and past top-k
        ([40], [40], 16, 4),  # a whole prompt
        ([24, 1, 9], [90, 65, 9], 16, 4),  # a later chunk, a decode row and a first chunk in one step
        ([7, 1], [300, 300], 8, 3),
        ([], [], 16, 4),
    ],
)
def test_selection_counts_match_the_reference_selection(query_lens, seq_lens, block_size, topk):
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    counts = selection_counts(starts, np.asarray(seq_lens, dtype=np.int32), block_size, topk)
    assert counts == _reference_counts(query_lens, seq_lens, block_size, topk)


def test_the_monitor_counts_every_msa_layer_and_times_its_scans_on_the_cpu():
    monitor = MsaMonitor(num_msa_layers=3, block_size=16, topk_blocks=4, device=torch.device("cpu"))
    monitor.count_step(np.array([0, 1, 41], dtype=np.int32), np.array([200, 40], dtype=np.int32))
    with monitor.index_scan("decode", 1):
        time.sleep(0.01)
    with index_scan(None, "decode", 1):  # no monitor: nothing to count
        time.sleep(0.01)
    stats = monitor.stats()
    assert (stats.decode.selected_blocks, stats.decode.candidate_blocks) == (3 * 4, 3 * 13)
    prefill_candidates = 3 * (16 * 1 + 16 * 2 + 8 * 3)
    assert (stats.prefill.selected_blocks, stats.prefill.candidate_blocks) == (prefill_candidates, prefill_candidates)
    assert 0.01 <= stats.decode.index_scan_seconds < 1
    assert (stats.decode.timed_index_scans, stats.decode.timed_index_scan_tokens) == (1, 1)
    assert stats.prefill.index_scan_seconds == 0 and stats.prefill.timed_index_scans == 0


def test_the_gpu_backend_times_its_prefill_and_decode_indexers(tiny_model_dir, monkeypatch):
    """A 40-token prompt takes the prefill indexer (40 tokens x 2 index heads exceed the decode scan's columns) in
    each of the tiny model's 3 MSA layers; its 2 fed-back tokens take the decode indexer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    core = build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, attention="msa"))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    offline.generate(core, [build_request(core.info, "r", list(range(40)), sampling)])
    stats = core.stats().msa
    assert stats is not None
    assert (stats.prefill.timed_index_scans, stats.prefill.timed_index_scan_tokens) == (3, 3 * 40)
    assert (stats.decode.timed_index_scans, stats.decode.timed_index_scan_tokens) == (3 * 2, 3 * 2)
    assert stats.prefill.index_scan_seconds > 0 and stats.decode.index_scan_seconds > 0
    # Positions 40 and 41 see 3 blocks, all selected (top-4).
    assert stats.decode.selected_blocks == stats.decode.candidate_blocks == 3 * 2 * 3


def test_a_scan_that_raises_is_not_timed():
    monitor = MsaMonitor(num_msa_layers=1, block_size=16, topk_blocks=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError), monitor.index_scan("prefill", 8):
        raise RuntimeError("the indexer failed")
    assert monitor.stats().prefill.timed_index_scans == 0


def test_one_step_in_n_of_those_that_scan_is_timed_whole():
    """Steps that replay a CUDA graph (counted, no scan) take no turn; a timed step times every layer's scan."""
    sampler = StepSampler(every=3)
    timed = []
    for eager in (True, False, True, True, False, False, True, True, True):
        sampler.new_step()
        if eager:
            decisions = {sampler.times_scan() for _ in range(4)}  # 4 MSA layers
            assert len(decisions) == 1
            timed.append(decisions.pop())
    assert timed == [True, False, False, True, False, False]  # the 1st and 4th eager steps
    with pytest.raises(ValueError):
        StepSampler(every=0)


class _HostEvent:
    """Stands in for ``torch.cuda.Event(enable_timing=True)``: the device passes it when the test says, at a time."""

    created = 0

    def __init__(self) -> None:
        _HostEvent.created += 1
        self.passed_at_ms: float | None = None

    def query(self) -> bool:
        return self.passed_at_ms is not None

    def elapsed_time(self, end_event: "_HostEvent") -> float:
        if self.passed_at_ms is None or end_event.passed_at_ms is None:  # CUDA: cudaErrorNotReady
            raise RuntimeError("elapsed_time of an event the device has not passed")
        return end_event.passed_at_ms - self.passed_at_ms


def _timings(max_in_flight: int = 8) -> tuple[EventTimings[_HostEvent], list[tuple[str, float, int]]]:
    timed: list[tuple[str, float, int]] = []
    timings = EventTimings(_HostEvent, lambda phase, seconds, tokens: timed.append((phase, seconds, tokens)),
                           max_in_flight=max_in_flight)  # fmt: skip
    return timings, timed


def _record(timings: EventTimings[_HostEvent], phase, tokens: int) -> tuple[_HostEvent, _HostEvent]:
    pair = timings.take()
    assert pair is not None
    timings.add(phase, tokens, pair)
    return pair


def test_event_pairs_are_read_once_passed_and_in_order():
    timings, timed = _timings()
    first, second = _record(timings, "prefill", 40), _record(timings, "decode", 4)
    timings.collect()
    assert timed == [] and timings.in_flight == 2  # nothing passed: nothing read, nothing waited for
    first[0].passed_at_ms, first[1].passed_at_ms = 10.0, 12.5
    second[0].passed_at_ms = 12.5
    timings.collect()
    assert timed == [("prefill", 0.0025, 40)] and timings.in_flight == 1
    second[1].passed_at_ms = 13.0
    timings.collect()
    assert timed == [("prefill", 0.0025, 40), ("decode", 0.0005, 4)] and timings.in_flight == 0


def test_event_pairs_are_pooled_and_those_in_flight_bounded():
    """A step timed every 16 makes no new events once the pool holds enough, and a device that never passes them
    (or nobody collecting) cannot grow the waiting list past its bound: the scans beyond it go untimed."""
    timings, timed = _timings(max_in_flight=3)
    _HostEvent.created = 0
    pairs = [_record(timings, "decode", 1) for _ in range(3)]
    assert timings.take() is None and timings.in_flight == 3 and _HostEvent.created == 6
    for pair in pairs:
        pair[0].passed_at_ms, pair[1].passed_at_ms = 0.0, 1.0
    reused = timings.take()  # full: it reads the passed pairs back first
    assert len(timed) == 3 and timings.in_flight == 0
    assert reused is not None and any(reused[0] is start and reused[1] is end for start, end in pairs)
    assert _HostEvent.created == 6
    timings.give_back(reused)  # the scan raised: the pair goes back unread
    assert timings.take() is reused and len(timed) == 3
    timings.clear()
    assert timings.take() is not reused and _HostEvent.created == 8


def test_the_warm_up_leaves_msa_counters_at_zero(tiny_model_dir):
    """The warm-up's steps are no user's (and on a GPU its timed scans would bracket kernel compiles): after it,
    the counters start from zero and count a request exactly as a fresh engine's do."""

    def serve(core) -> None:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
        offline.generate(core, [build_request(core.info, "r", list(range(3, 90)), sampling)])

    settings = {"model": str(tiny_model_dir), "num_kv_blocks": 256, "max_model_len": 1024}
    fresh, warmed = build_engine_core(EngineConfig(**settings)), build_engine_core(EngineConfig(**settings))
    warm_up(warmed)
    stats = warmed.stats().msa
    assert stats is not None
    zero = (0, 0, 0.0, 0, 0)
    assert astuple(stats.prefill) == astuple(stats.decode) == zero
    serve(fresh)
    serve(warmed)
    counts = [(phase.selected_blocks, phase.candidate_blocks, phase.timed_index_scans)
              for core in (fresh, warmed) for phase in (core.stats().msa.prefill, core.stats().msa.decode)]  # fmt: skip
    assert counts[:2] == counts[2:] and counts[0][0] > 0


@pytest.mark.slow
def test_a_tensor_parallel_engine_counts_each_step_once(tiny_model_dir):
    """Rank 0 counts and times; the other rank keeps no monitor: two ranks count what one does."""
    settings = {"model": str(tiny_model_dir), "num_kv_blocks": 64, "max_num_batched_tokens": 64, "cpu_threads": 1}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    counts = []
    for parallel in (None, ParallelConfig(tensor_parallel=2)):
        core = build_engine_core(EngineConfig(**settings, **({"parallel": parallel} if parallel else {})))
        try:
            offline.generate(core, [build_request(core.info, "r", list(range(3, 150)), sampling)])
            stats = core.stats().msa
            assert stats is not None
            counts.append([(p.selected_blocks, p.candidate_blocks, p.timed_index_scans, p.timed_index_scan_tokens)
                           for p in (stats.prefill, stats.decode)])  # fmt: skip
        finally:
            if parallel is not None:
                stop_parallel_engine(core)
    assert counts[0] == counts[1]
    assert counts[0][0][0] < counts[0][0][1]  # 150 tokens are past top-4 blocks of 16: selection is sparse
