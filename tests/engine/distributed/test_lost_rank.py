"""A parallel engine one of whose ranks dies exits at once, naming the rank (``m3stack engine --tensor-parallel 2``
as a real process, CPU, gloo).  Without the watch an idle engine never notices (it runs no collective) and keeps
reporting itself healthy, and a busy one waits in its next collective for the whole timeout.
"""

import os
import signal
import time
from pathlib import Path

import grpc

from m3stack.engine.distributed.processes import LOST_RANK_EXIT_CODE
from m3stack.local.processes import free_port, http_ok
from m3stack.proto import engine_pb2 as pb
from m3stack.proto import engine_pb2_grpc
from tests.helpers.engine_process import LOOPBACK, start_engine_process, wait_engine_loaded

EXIT_WITHIN_S = 30


def _spawned_ranks(pid: int) -> list[int]:
    """The engine's worker ranks: its children started by multiprocessing's spawn (not its resource tracker)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_killed_rank_ends_the_engine_with_a_message(tiny_model_dir):
    port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
    process = start_engine_process(
        "--model", str(tiny_model_dir), "--port", str(port), "--metrics-port", str(metrics_port),
        "--tensor-parallel", "2", "--max-model-len", "256", "--kv-cache-gb", "0.05",
    )  # fmt: skip
    try:
        wait_engine_loaded(process, metrics_port)
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:  # both ranks serve a request first
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=3)
            request = pb.GenerateRequest(request_id="a", input_ids=[1, 2, 3], sampling=sampling)
            responses = list(engine_pb2_grpc.EngineStub(channel).Generate(request))
            assert responses[-1].complete.completion_tokens == 3
        (rank,) = _spawned_ranks(process.pid)
        os.kill(rank, signal.SIGKILL)  # the engine idles: nothing of its own would meet the dead rank
        deadline = time.monotonic() + EXIT_WITHIN_S
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert process.poll() == LOST_RANK_EXIT_CODE, "the engine outlived its rank 1"
        log = process.stdout.read()
        assert f"(pid {rank}) exited with code -9" in log and "m3stack-rank1" in log, log[-2000:]
        assert not http_ok(f"http://{LOOPBACK}:{metrics_port}/health", timeout_s=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ctrl_c_to_the_whole_group_drains_and_stops_cleanly(tiny_model_dir):
    """A terminal's Ctrl-C signals every process of the foreground group, the spawned rank too, here mid-request:
    the rank must leave the stop to rank 0, which drains (the request ends as aborted by the drain) and exits 0,
    not take the signal, die, and make rank 0 exit as if it had crashed."""
    port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
    process = start_engine_process(
        "--model", str(tiny_model_dir), "--port", str(port), "--metrics-port", str(metrics_port),
        "--tensor-parallel", "2", "--max-model-len", "600", "--kv-cache-gb", "0.05", "--drain-timeout", "1",
    )  # fmt: skip
    try:
        wait_engine_loaded(process, metrics_port)
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=590, ignore_eos=True)
            request = pb.GenerateRequest(request_id="long", input_ids=[4, 5], sampling=sampling)
            call = engine_pb2_grpc.EngineStub(channel).Generate(request)
            next(call)  # both ranks are stepping
            os.killpg(process.pid, signal.SIGINT)
            tail = list(call)
        assert tail[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
        assert process.wait(EXIT_WITHIN_S) == 0
        log = process.stdout.read()
        assert "engine stopped" in log and "exited with code" not in log, log[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
