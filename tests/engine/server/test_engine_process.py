"""``m3stack engine`` as a real process: the ready line and /loaded, serving, drain on SIGTERM, startup errors."""

import signal
import threading

import grpc

from m3stack.local.processes import free_port, http_ok
from m3stack.proto import engine_pb2 as pb
from m3stack.proto import engine_pb2_grpc
from tests.helpers.engine_process import LOOPBACK, start_engine_process, wait_engine_loaded


def test_the_engine_process_serves_then_drains_on_sigterm(tiny_model_dir):
    port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
    process = start_engine_process(
        "--model", str(tiny_model_dir), "--port", str(port), "--metrics-port", str(metrics_port),
        "--drain-timeout", "1", "--max-model-len", "600", "--kv-cache-gb", "0.05",
    )  # fmt: skip
    try:
        wait_engine_loaded(process, metrics_port)
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=3)
            responses = list(stub.Generate(pb.GenerateRequest(request_id="a", input_ids=[1, 2, 3], sampling=sampling)))
            assert responses[-1].complete.completion_tokens == 3
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).max_context_length == 600

            long_sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=590, ignore_eos=True)
            call = stub.Generate(pb.GenerateRequest(request_id="long", input_ids=[4, 5], sampling=long_sampling))
            next(call)
            tail: list = []
            reader = threading.Thread(target=lambda: tail.extend(call))
            reader.start()
            process.send_signal(signal.SIGTERM)
            reader.join(60)
            assert tail[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
            assert "drain" in tail[-1].complete.abort_message
        assert process.wait(60) == 0
        log = process.stdout.read()
        assert "m3stack engine ready: grpc 127.0.0.1:" in log and "engine stopped" in log
        assert not http_ok(f"http://{LOOPBACK}:{metrics_port}/health", timeout_s=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_missing_checkpoint_exits_1_naming_it():
    process = start_engine_process("--model", "/nonexistent/checkpoint", "--port", str(free_port(LOOPBACK)))
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 1, output
    assert "'/nonexistent/checkpoint' is not a folder" in output
