"""MSA's metrics on the GPU (``engine.msa.metrics``): the CUDA path that times index scans with events.

On the monitor alone: events go on the stream that runs the scan and are read back once the GPU passed them, never
waited for; a scan inside a CUDA graph capture records nothing (capture succeeds, replays are not timed); a scan
during which Triton compiled a kernel is not timed.  On an engine (test_runtime's tiny model with dense MLPs, whose
decode forward can be captured; warmed up as the builder does on a GPU) with and without decode CUDA graphs: the
counters start at zero after the warm-up, the selected and candidate blocks are the host rule's exactly (graph
replays included), one eager step in ``GPU_SAMPLE_EVERY`` has every MSA layer's scan timed, and the times are
plausible.
"""

import json
import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from m3stack.engine import kernel_compiles
from m3stack.engine.attention.gpu import GpuAttentionBackend
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.msa.metrics import GPU_SAMPLE_EVERY, MsaMonitor, MsaPhaseStats
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from tests.gpu.test_runtime import _dense_mlp_core

# torch.cuda._sleep spins this many GPU cycles: >= 100 ms at the H200's top clock (1.98 GHz).
SLEEP_CYCLES = 200_000_000
SLEEP_MIN_S = 0.1
PROMPT_LENGTHS = (300, 150, 97, 70)  # all past the top-4 blocks of 16 tokens: selection is sparse
NEW_TOKENS = 64  # 1 prefill + 63 decode steps: eagerly, steps 0, 16, 32 and 48 are timed


def _monitor(sample_every: int = 1) -> MsaMonitor:
    monitor = MsaMonitor(num_msa_layers=1, block_size=16, topk_blocks=4, device=torch.device("cuda"),
                         sample_every=sample_every)  # fmt: skip
    monitor.count_step(np.array([0, 1], dtype=np.int32), np.array([1], dtype=np.int32))
    return monitor


def test_scan_events_go_on_the_scans_stream_and_are_read_once_passed():
    monitor = _monitor()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), monitor.index_scan("prefill", 8):
        torch.cuda._sleep(SLEEP_CYCLES)
    assert monitor.stats().prefill.timed_index_scans == 0  # the GPU is still sleeping: not read, not waited for
    torch.cuda.synchronize()
    stats = monitor.stats().prefill
    assert (stats.timed_index_scans, stats.timed_index_scan_tokens) == (1, 8)
    # Events on another stream than the scan's would bracket nothing.
    assert SLEEP_MIN_S <= stats.index_scan_seconds < 1.0


def test_a_scan_captured_in_a_cuda_graph_records_no_event():
    """Events recorded while capturing would be illegal (the capture fails) and would not time the replays."""
    monitor = _monitor()
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture's warm-up, outside it
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), monitor.index_scan("decode", 1):
        x.add_(1)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert x.item() == 4.0 and monitor.stats().decode.timed_index_scans == 0
    with monitor.index_scan("decode", 1):  # the same step's eager scans are still timed
        x.add_(1)
    torch.cuda.synchronize()
    assert monitor.stats().decode.timed_index_scans == 1


@triton.jit
def _add_kernel(x_ptr, value: tl.constexpr):
    tl.store(x_ptr, tl.load(x_ptr) + value)


def test_a_scan_during_a_kernel_compile_is_not_timed():
    """Its events would bracket the host's compile (seconds); the kernel's next launch is timed."""
    assert kernel_compiles.watch(), "this Triton has no JIT hooks"
    monitor = _monitor()
    x = torch.zeros(1, device="cuda")
    value = random.randrange(1, 2**20)  # a specialization no earlier run left in Triton's disk cache; float32-exact
    before = kernel_compiles.snapshot().count
    with monitor.index_scan("prefill", 1):
        _add_kernel[(1,)](x, value=value)
    assert kernel_compiles.snapshot().count > before, "the launch compiled nothing"
    with monitor.index_scan("prefill", 1):
        _add_kernel[(1,)](x, value=value)
    torch.cuda.synchronize()
    assert x.item() == 2.0 * value
    assert monitor.stats().prefill.timed_index_scans == 1


def _tiny_text_config() -> dict:
    return json.loads((ensure_tiny_checkpoint() / "config.json").read_text())["text_config"]


def _serve(core, seed: int) -> None:
    """All prompts in one prefill step, then NEW_TOKENS - 1 decode steps of all of them."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [build_request(core.info, f"s{seed}-{index}", [rng.randrange(380) for _ in range(length)], sampling)
                for index, length in enumerate(PROMPT_LENGTHS)]  # fmt: skip
    offline.generate(core, requests)


def _host_rule(positions: list[range], block_size: int, topk: int) -> tuple[int, int]:
    visible = [p // block_size + 1 for span in positions for p in span]
    return sum(min(topk, v) for v in visible), sum(visible)


def _steps(core) -> tuple[int, int]:
    return core.runner.num_eager_steps, core.runner.num_graph_steps


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_served_engine_counts_blocks_and_times_one_eager_step_in_n(cuda_graphs: bool):
    # Assembled as the server assembles it on a GPU: graphs captured (or not), then the warm-up.
    core = _dense_mlp_core(cuda_graphs=cuda_graphs, async_scheduling=True)
    assert isinstance(core.runner.backend, GpuAttentionBackend) and core.msa is not None
    if cuda_graphs:  # a capture that met the monitor's events would have failed, and decode run eagerly
        assert core.runner.decode_graphs is not None and core.runner.decode_graphs.captured
    zero = MsaPhaseStats(0, 0, 0.0, 0, 0)
    assert core.stats().msa.prefill == core.stats().msa.decode == zero, "the warm-up's steps were counted"
    _serve(core, seed=1)  # meets any kernel specialization the warm-up did not
    core.msa.reset()
    before, compiles = _steps(core), kernel_compiles.snapshot().count
    _serve(core, seed=2)
    eager, graph = (after - earlier for after, earlier in zip(_steps(core), before, strict=True))
    compiled = kernel_compiles.snapshot().count - compiles
    stats = core.stats().msa

    text = _tiny_text_config()
    layers = text["layer_types"].count("minimax_m3_sparse")
    block, topk = text["index_block_size"], text["index_topk_blocks"]
    prefill = _host_rule([range(n) for n in PROMPT_LENGTHS], block, topk)
    decode = _host_rule([range(n, n + NEW_TOKENS - 1) for n in PROMPT_LENGTHS], block, topk)
    assert (stats.prefill.selected_blocks, stats.prefill.candidate_blocks) == (layers * prefill[0], layers * prefill[1])
    assert (stats.decode.selected_blocks, stats.decode.candidate_blocks) == (layers * decode[0], layers * decode[1])
    assert stats.decode.selected_blocks < stats.decode.candidate_blocks

    assert eager + graph == NEW_TOKENS
    assert graph >= NEW_TOKENS - 2 if cuda_graphs else graph == 0
    # Eager steps 0, 16, 32, ... are timed: the prefill step, then every 16th eager decode step.
    timed_decode_steps = len(range(GPU_SAMPLE_EVERY, eager, GPU_SAMPLE_EVERY))
    expected = {"prefill": (layers, layers * sum(PROMPT_LENGTHS)),
                "decode": (layers * timed_decode_steps, layers * timed_decode_steps * len(PROMPT_LENGTHS))}  # fmt: skip
    for phase, (scans, tokens) in expected.items():
        counted = getattr(stats, phase)
        got = (counted.timed_index_scans, counted.timed_index_scan_tokens)
        if compiled:  # a scan during a kernel compile is not timed
            assert counted.timed_index_scans <= scans, (phase, got, compiled)
        else:
            assert got == (scans, tokens), phase
        if counted.timed_index_scans:
            mean = counted.index_scan_seconds / counted.timed_index_scans
            assert 1e-6 < mean < 1.0, (phase, mean)
    assert stats.prefill.timed_index_scans > 0 or compiled
    if not cuda_graphs:
        assert timed_decode_steps == 3 and (stats.decode.timed_index_scans > 0 or compiled)
