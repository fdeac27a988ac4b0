"""``engine.msa.metrics``: the host-side block counts agree with what the reference selection holds, the monitor
times what its scans bracket, and the GPU backend (Triton interpreted) times both of its indexers in an engine."""

import time

import numpy as np
import pytest
import torch

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.msa.metrics import MsaMonitor, index_scan, selection_counts
from m3stack.engine.msa.reference import block_scores, index_block_topk
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request


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
