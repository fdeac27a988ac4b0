"""What MSA did, cumulative since the engine started: the KV blocks its layers selected out of those they could
see, and the time its indexer took.  ``/metrics`` exports these as ``m3stack_engine_msa_*``.

Block counts are taken on the host from the step's lengths, before the forward is launched: a query token at
position ``p`` sees ``p // B + 1`` blocks (its candidates, what dense attention would read) and every index head
selects ``min(K, p // B + 1)`` of them (docs/msa.md#semantics), so counting costs no device work and covers
CUDA-graph replays.  A request adding one token in a step counts as decode, any other as prefill.

Index scan times bracket the indexer of one MSA layer (scores and block top-k): on CUDA with events, on one
eager step in ``sample_every`` of those that run the indexer, because events cannot be timed inside a replayed
CUDA graph and recording them around every layer would slow the step; elsewhere (CPU) with the wall clock around
every scan, which is synchronous there.  Event pairs are read once the GPU has passed them, never waited for.
"""

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")
# On CUDA: one eager step in this many that runs the indexer has its scans timed.
GPU_SAMPLE_EVERY = 16
# Timed scans the GPU may not have reached yet are read back once this many are waiting.
_COLLECT_AT = 256


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


@dataclass
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
        return MsaPhaseStats(**asdict(self))


@dataclass(frozen=True)
class _PendingScan:
    phase: Phase
    num_tokens: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class MsaMonitor:
    """The counters of one engine's MSA layers: the runner counts each launched step (``count_step``), the attention
    backend times its indexer (``index_scan``), the engine reads ``stats``."""

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
        self.uses_events = device.type == "cuda"
        self.sample_every = sample_every
        self._counters: dict[Phase, _Counters] = {phase: _Counters() for phase in PHASES}
        self._pending: list[_PendingScan] = []
        self._new_step = False
        self._scanned_steps = 0
        self._timing_step = False

    def count_step(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> None:
        """Count the blocks a step's MSA layers select (its host lengths, padding excluded)."""
        counts = selection_counts(query_start_loc, seq_lens, self.block_size, self.topk_blocks)
        for phase, (selected, candidates) in counts.items():
            counters = self._counters[phase]
            counters.selected_blocks += selected * self.num_msa_layers
            counters.candidate_blocks += candidates * self.num_msa_layers
        self._new_step = True

    @contextmanager
    def index_scan(self, phase: Phase, num_tokens: int) -> Iterator[None]:
        """Times what runs inside as one indexer run of ``num_tokens`` query tokens, when this scan is sampled."""
        if not self.uses_events:
            started = time.perf_counter()
            yield
            self._counters[phase].add_scan(time.perf_counter() - started, num_tokens)
            return
        if not self._samples_scan():
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append(_PendingScan(phase, num_tokens, start, end))
        if len(self._pending) >= _COLLECT_AT:  # nobody reads the statistics (an offline engine): keep it bounded
            self._collect()

    def _samples_scan(self) -> bool:
        if self._new_step:  # the first scan of a counted step decides for all of its scans
            self._new_step = False
            self._timing_step = self._scanned_steps % self.sample_every == 0
            self._scanned_steps += 1
        # Events recorded into a CUDA graph would not time its replays.
        return self._timing_step and not torch.cuda.is_current_stream_capturing()

    def _collect(self) -> None:
        waiting = []
        for scan in self._pending:
            if scan.end.query():
                self._counters[scan.phase].add_scan(scan.start.elapsed_time(scan.end) / 1e3, scan.num_tokens)
            else:
                waiting.append(scan)
        self._pending = waiting

    def stats(self) -> MsaStats:
        self._collect()
        return MsaStats(prefill=self._counters["prefill"].frozen(), decode=self._counters["decode"].frozen())


def index_scan(monitor: MsaMonitor | None, phase: Phase, num_tokens: int) -> AbstractContextManager[None]:
    """``monitor.index_scan(...)``, or nothing to time without a monitor."""
    return monitor.index_scan(phase, num_tokens) if monitor is not None else nullcontext()
