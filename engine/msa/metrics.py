"""What MSA did, cumulative since the engine started: the KV blocks its layers selected out of those they could
see, and the time its indexer took.  ``/metrics`` exports these as ``m3stack_engine_msa_*``.

Block counts are taken on the host from the step's lengths, before the forward is launched: a query token at
position ``p`` sees ``p // B + 1`` blocks (its candidates, what dense attention would read) and every index head
selects ``min(K, p // B + 1)`` of them (docs/msa.md#semantics), so counting costs no device work and covers
CUDA-graph replays.  A request adding one token in a step counts as decode, any other as prefill.

Index scan times bracket the indexer of one MSA layer (scores and block top-k).  On the CPU the wall clock times
every scan, which is synchronous there.  On CUDA a pair of events brackets the scans of one eager step in
``sample_every`` among those that run the indexer (``StepSampler``): a replayed CUDA graph runs no Python, so its
scans cannot be timed (its blocks are still counted), events recorded into a graph being captured would be illegal,
and events around every layer of every step would slow it.  The events go on the stream of the engine's device
that runs the scan, come from a pool and are read back once the GPU has passed them, never waited for
(``EventTimings``, which bounds how many are in flight).  A scan during which Triton compiled a kernel is not
timed: its events would bracket seconds of host work.  A parallel engine keeps one monitor, on rank 0, which counts
each step once and times its own shard's scans; the other ranks have none, so nothing is counted twice.
"""

import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np
import torch

from m3stack.engine import kernel_compiles

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")
# On CUDA: one eager step in this many that runs the indexer has its scans timed.
GPU_SAMPLE_EVERY = 16
# Timed scans waiting for the GPU to pass them, at most (a sampled step times one scan per MSA layer and phase).
MAX_SCANS_IN_FLIGHT = 256


@dataclass(frozen=True)
class MsaPhaseStats:
    selected_blocks: int  # KV blocks selected, summed over query tokens and MSA layers (each index head as many)
    candidate_blocks: int  # blocks those tokens could see: what dense attention reads
    index_scan_seconds: float  # time of the timed index scans
    timed_index_scans: int  # indexer runs timed (GPU backend: one MSA layer of one step)
    timed_index_scan_tokens: int  # query tokens those runs scored


@dataclass(frozen=True)
class MsaStats:
    prefill: MsaPhaseStats
    decode: MsaPhaseStats


def selection_counts(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, block_size: int, topk: int
) -> dict[Phase, tuple[int, int]]:
    """(selected, candidate) blocks of one MSA layer over a step's query tokens, by phase.

    Request ``r`` adds ``query_start_loc[r + 1] - query_start_loc[r]`` tokens at the last positions of its
    ``seq_lens[r]``; one token is decode, more are prefill."""
    query_lens = np.diff(query_start_loc.astype(np.int64))
    seq_lens = seq_lens.astype(np.int64)
    decode = query_lens == 1
    # Decode: one position per request, its last.
    visible = (seq_lens[decode] - 1) // block_size + 1
    counts: dict[Phase, tuple[int, int]] = {"decode": (int(np.minimum(visible, topk).sum()), int(visible.sum()))}
    if len(visible) == len(query_lens):  # a pure-decode step: skip the empty prefill arithmetic (the common step)
        counts["prefill"] = (0, 0)
        return counts
    # Prefill: every position of each chunk.
    chunk_lens, ends = query_lens[~decode], seq_lens[~decode]
    positions = np.repeat(ends - chunk_lens, chunk_lens) + _ranks(chunk_lens)
    visible = positions // block_size + 1
    counts["prefill"] = (int(np.minimum(visible, topk).sum()), int(visible.sum()))
    return counts


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """0 .. n-1 for each length n, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts


@dataclass(slots=True)
class _Counters:
    selected_blocks: int = 0
    candidate_blocks: int = 0
    index_scan_seconds: float = 0.0
    timed_index_scans: int = 0
    timed_index_scan_tokens: int = 0

    def add_scan(self, seconds: float, num_tokens: int) -> None:
        self.index_scan_seconds += seconds
        self.timed_index_scans += 1
        self.timed_index_scan_tokens += num_tokens

    def frozen(self) -> MsaPhaseStats:
        return MsaPhaseStats(self.selected_blocks, self.candidate_blocks, self.index_scan_seconds,
                             self.timed_index_scans, self.timed_index_scan_tokens)  # fmt: skip


class StepSampler:
    """Which scans the CUDA path times: all scans of one step in ``every`` among the steps that run the indexer.

    ``new_step`` marks a counted step; its first scan decides for the step.  A step that replays a CUDA graph runs no
    scan, so it neither takes a turn nor is timed."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"sample every {every} steps: must be at least 1")
        self.every = every
        self._new_step = False
        self._scanned_steps = 0
        self._timing = False

    def new_step(self) -> None:
        self._new_step = True

    def times_scan(self) -> bool:
        if self._new_step:
            self._new_step = False
            self._timing = self._scanned_steps % self.every == 0
            self._scanned_steps += 1
        return self._timing


class TimingEvent(Protocol):
    """What ``EventTimings`` reads of an event (``torch.cuda.Event(enable_timing=True)``); its caller records it."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds from this event to ``end_event``


Event = TypeVar("Event", bound=TimingEvent)


@dataclass(frozen=True, slots=True)
class _TimedScan(Generic[Event]):
    phase: Phase
    num_tokens: int
    start: Event
    end: Event


class EventTimings(Generic[Event]):
    """The bookkeeping of scans timed by (start, end) event pairs: pairs come from a pool (``take``), a recorded pair
    waits in order (``add``) until the device passed its end (``collect``), then its time goes to ``on_timed`` and
    the pair back to the pool.  At most ``max_in_flight`` pairs wait: past that a scan is not timed."""

    def __init__(
        self,
        new_event: Callable[[], Event],
        on_timed: Callable[[Phase, float, int], None],
        max_in_flight: int = MAX_SCANS_IN_FLIGHT,
    ) -> None:
        self._new_event = new_event
        self._on_timed = on_timed
        self.max_in_flight = max_in_flight
        self._in_flight: deque[_TimedScan[Event]] = deque()
        self._free: list[tuple[Event, Event]] = []

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def take(self) -> tuple[Event, Event] | None:
        """A pair to record around a scan, or None when too many wait (nobody collected: an offline engine)."""
        if len(self._in_flight) >= self.max_in_flight:
            self.collect()
            if len(self._in_flight) >= self.max_in_flight:
                return None
        if self._free:
            return self._free.pop()
        return self._new_event(), self._new_event()

    def add(self, phase: Phase, num_tokens: int, pair: tuple[Event, Event]) -> None:
        """A pair recorded around a scan of ``num_tokens`` query tokens."""
        self._in_flight.append(_TimedScan(phase, num_tokens, *pair))

    def give_back(self, pair: tuple[Event, Event]) -> None:
        """A pair taken but not to be read (the scan raised, or is not to be timed)."""
        self._free.append(pair)

    def collect(self) -> None:
        """Read the pairs the device has passed.  They were recorded in order on one stream, so the first that has
        not passed ends the read; ``query`` never waits."""
        while self._in_flight and self._in_flight[0].end.query():
            scan = self._in_flight.popleft()
            self._on_timed(scan.phase, scan.start.elapsed_time(scan.end) / 1e3, scan.num_tokens)
            self._free.append((scan.start, scan.end))

    def clear(self) -> None:
        """Forget every pair, waiting or free (a pending event may be released: CUDA frees it once passed)."""
        self._in_flight.clear()
        self._free.clear()


class _WallClockScan:
    """Times a synchronous (CPU) scan."""

    __slots__ = ("_counters", "_num_tokens", "_started")

    def __init__(self, counters: _Counters, num_tokens: int) -> None:
        self._counters = counters
        self._num_tokens = num_tokens
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self._counters.add_scan(time.perf_counter() - self._started, self._num_tokens)


class _EventScan:
    """Records an event pair around a scan, on the stream of ``device`` current at its start."""

    __slots__ = ("_compiles", "_device", "_num_tokens", "_pair", "_phase", "_stream", "_timings")

    def __init__(self, timings: "EventTimings[torch.cuda.Event]", phase: Phase, num_tokens: int,
                 pair: tuple[torch.cuda.Event, torch.cuda.Event], device: torch.device) -> None:  # fmt: skip
        self._timings = timings
        self._phase = phase
        self._num_tokens = num_tokens
        self._pair = pair
        self._device = device
        self._stream: torch.cuda.Stream | None = None
        self._compiles = 0

    def __enter__(self) -> None:
        self._compiles = kernel_compiles.snapshot().count
        self._stream = torch.cuda.current_stream(self._device)
        self._pair[0].record(self._stream)

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None or kernel_compiles.snapshot().count != self._compiles:
            self._timings.give_back(self._pair)
            return
        self._pair[1].record(self._stream)
        self._timings.add(self._phase, self._num_tokens, self._pair)


def _new_timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class MsaMonitor:
    """The counters of one engine's MSA layers: the runner counts each launched step (``count_step``), the attention
    backend times its indexer (``index_scan``), the engine reads ``stats``, the warm-up ``reset``s them."""

    def __init__(
        self,
        *,
        num_msa_layers: int,
        block_size: int,
        topk_blocks: int,
        device: torch.device,
        sample_every: int = GPU_SAMPLE_EVERY,
    ) -> None:
        self.num_msa_layers = num_msa_layers
        self.block_size = block_size
        self.topk_blocks = topk_blocks
        self.device = device
        self.sample_every = sample_every
        self._counters: dict[Phase, _Counters] = {phase: _Counters() for phase in PHASES}
        self._sampler = StepSampler(sample_every)
        uses_events = device.type == "cuda"
        self._timings: EventTimings[torch.cuda.Event] | None = (
            EventTimings(_new_timing_event, self._add_scan) if uses_events else None
        )

    def count_step(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> None:
        """Count the blocks a step's MSA layers select (its host lengths, padding excluded)."""
        counts = selection_counts(query_start_loc, seq_lens, self.block_size, self.topk_blocks)
        for phase, (selected, candidates) in counts.items():
            counters = self._counters[phase]
            counters.selected_blocks += selected * self.num_msa_layers
            counters.candidate_blocks += candidates * self.num_msa_layers
        self._sampler.new_step()

    def index_scan(self, phase: Phase, num_tokens: int) -> AbstractContextManager[None]:
        """Times what runs inside as one indexer run of ``num_tokens`` query tokens, when this scan is timed.  Called
        around every MSA layer of every eager step: a scan that is not timed allocates nothing."""
        if self._timings is None:
            return _WallClockScan(self._counters[phase], num_tokens)
        # Events recorded into a CUDA graph being captured would not time its replays, and are illegal there.
        if not self._sampler.times_scan() or torch.cuda.is_current_stream_capturing():
            return _NOT_TIMED
        pair = self._timings.take()
        if pair is None:
            return _NOT_TIMED
        return _EventScan(self._timings, phase, num_tokens, pair, self.device)

    def _add_scan(self, phase: Phase, seconds: float, num_tokens: int) -> None:
        self._counters[phase].add_scan(seconds, num_tokens)

    def stats(self) -> MsaStats:
        if self._timings is not None:
            self._timings.collect()
        return MsaStats(prefill=self._counters["prefill"].frozen(), decode=self._counters["decode"].frozen())

    def reset(self) -> None:
        """Start again from zero (after the warm-up, whose steps compile kernels and are no user's)."""
        self._counters = {phase: _Counters() for phase in PHASES}
        self._sampler = StepSampler(self.sample_every)
        if self._timings is not None:
            self._timings.clear()


_NOT_TIMED: AbstractContextManager[None] = nullcontext()  # stateless: one serves every scan that is not timed


def index_scan(monitor: MsaMonitor | None, phase: Phase, num_tokens: int) -> AbstractContextManager[None]:
    """``monitor.index_scan(...)``, or nothing to time without a monitor."""
    return monitor.index_scan(phase, num_tokens) if monitor is not None else _NOT_TIMED
