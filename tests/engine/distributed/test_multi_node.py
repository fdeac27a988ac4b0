"""A two-node engine as two ``m3stack engine`` processes on loopback (CPU, gloo), started the way a LeaderWorkerSet
group's pods start it: ``--nnodes 2 --tensor-parallel 4``, the leader (``--node-rank 0``) serves gRPC, the worker
node (``--node-rank 1``) joins it at ``--master-addr``:``--master-port``, each node running two ranks.

It generates the greedy tokens of a one-process engine, and when the leader stops (SIGTERM) the worker node's
ranks stop with it and it exits 0.
"""

import signal
import subprocess

import grpc
import pytest

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.distributed.processes import LOST_RANK_EXIT_CODE
from m3stack.engine.model.tiny import write_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request
from m3stack.local.processes import free_port
from m3stack.proto import engine_pb2 as pb
from m3stack.proto import engine_pb2_grpc
from tests.helpers.engine_process import LOOPBACK, start_engine_process, wait_engine_loaded

NEW_TOKENS = 8
PROMPT = [(7 * i + 3) % 380 for i in range(150)]  # longer than the MSA selection window of the tiny model
ENGINE_FLAGS = ("--max-model-len", "256", "--kv-cache-gb", "0.05", "--cpu-threads", "1")
# Four KV heads and experts: two ranks on each of two nodes.
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 4, "index_n_heads": 4, "num_local_experts": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-4-kv-heads"), text_overrides=WIDE)


def _one_process_tokens(model_dir) -> list[int]:
    core = build_engine_core(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_gb=0.05, cpu_threads=1))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    request = build_request(core.info, "r", PROMPT, sampling)
    return offline.generate(core, [request])["r"].token_ids


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_two_node_engine_serves_and_stops_with_its_leader(model_dir):
    port, metrics_port, rendezvous = free_port(LOOPBACK), free_port(LOOPBACK), free_port(LOOPBACK)
    group = ("--model", str(model_dir), "--tensor-parallel", "4", "--nnodes", "2", "--master-port", str(rendezvous))
    leader = start_engine_process(*group, *ENGINE_FLAGS, "--node-rank", "0", "--port", str(port),
                                  "--metrics-port", str(metrics_port), "--drain-timeout", "1")  # fmt: skip
    worker = start_engine_process(*group, *ENGINE_FLAGS, "--node-rank", "1", "--master-addr", LOOPBACK)
    try:
        wait_engine_loaded(leader, metrics_port)
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            request = pb.GenerateRequest(request_id="r", input_ids=PROMPT, sampling=sampling)
            responses = list(engine_pb2_grpc.EngineStub(channel).Generate(request))
        tokens = [token for response in responses if response.HasField("chunk") for token in response.chunk.token_ids]
        assert responses[-1].complete.completion_tokens == NEW_TOKENS
        assert tokens == _one_process_tokens(model_dir)
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0, leader.stdout.read()
        assert worker.wait(60) == 0, worker.stdout.read()
    finally:
        _stop(leader)
        _stop(worker)


def test_a_worker_node_exits_when_its_leader_dies(model_dir):
    """The leader killed outright: the worker node must not wait for it forever (its ranks block on the leader's
    next message); it exits 1 with one line saying why, and LeaderWorkerSet recreates the group."""
    port, metrics_port, rendezvous = free_port(LOOPBACK), free_port(LOOPBACK), free_port(LOOPBACK)
    group = ("--model", str(model_dir), "--tensor-parallel", "4", "--nnodes", "2", "--master-port", str(rendezvous))
    leader = start_engine_process(*group, *ENGINE_FLAGS, "--node-rank", "0", "--port", str(port),
                                  "--metrics-port", str(metrics_port))  # fmt: skip
    worker = start_engine_process(*group, *ENGINE_FLAGS, "--node-rank", "1", "--master-addr", LOOPBACK)
    try:
        wait_engine_loaded(leader, metrics_port)
        leader.kill()
        leader.wait()
        assert worker.wait(60) == LOST_RANK_EXIT_CODE
        log = worker.stdout.read()
        assert "lost the engine's other ranks while waiting for a step" in log and "Traceback" not in log, log
    finally:
        _stop(leader)
        _stop(worker)
