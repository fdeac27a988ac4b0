"""engine.proto end to end over loopback gRPC: streams, concurrency, abort, cancellation, deadlines, health, loads."""

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from m3stack.proto import engine_pb2 as pb
from tests.helpers.serving import scrape, total


def generate_request(request_id: str, prompt: list[int], max_new_tokens: int = 8, **sampling) -> pb.GenerateRequest:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    return pb.GenerateRequest(request_id=request_id, input_ids=prompt, sampling=pb.SamplingParams(**params))


def collect(responses) -> tuple[list[int], list[pb.GenerateChunk], pb.GenerateComplete | None]:
    """Tokens, chunks and the completion of one Generate stream, checking the stream's shape."""
    tokens, chunks, complete = [], [], None
    for response in responses:
        assert complete is None, "a message arrived after the completion"
        if response.HasField("chunk"):
            chunks.append(response.chunk)
            tokens += response.chunk.token_ids
        else:
            complete = response.complete
    return tokens, chunks, complete


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(380) for _ in range(length)]


def test_model_info_describes_the_loaded_model(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_type == "minimax_m3_vl" and info.device == "cpu" and info.dtype == "float32"
    assert info.max_context_length == 512 and info.kv_block_size == 16
    assert info.vocab_size == server.core.info.vocab_size and list(info.eos_token_ids) == [390]
    assert info.supports_vision and info.image_token_id == server.core.info.image_token_id


def test_32_concurrent_streams_each_get_their_tokens(server):
    prompts = {f"c{i}": _prompt(i, 10 + 7 * i) for i in range(32)}

    def run(item):
        request_id, prompt = item
        return request_id, collect(server.stub.Generate(generate_request(request_id, prompt, 12), timeout=120))

    with ThreadPoolExecutor(32) as pool:
        results = dict(pool.map(run, prompts.items()))
    for request_id, (tokens, chunks, complete) in results.items():
        assert complete is not None and complete.finish_reason == pb.FINISH_REASON_LENGTH, request_id
        assert len(tokens) == 12 and complete.completion_tokens == 12
        assert complete.prompt_tokens == len(prompts[request_id])
        assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    # Batch invariance through the server: alone, the same prompts give the same greedy tokens.
    for request_id in ("c0", "c17", "c31"):
        alone, _, _ = collect(server.stub.Generate(generate_request(f"{request_id}-alone", prompts[request_id], 12)))
        assert alone == results[request_id][0]
    server.wait_idle()
    assert server.on_engine(lambda core: core.scheduler.kv.usage) == 0.0


def test_abort_mid_stream_ends_the_stream_and_frees_every_block(server):
    stream = server.stub.Generate(generate_request("to-abort", _prompt(99, 40), max_new_tokens=400), timeout=60)
    first = next(stream)
    assert first.HasField("chunk")
    assert server.stub.Abort(pb.AbortRequest(request_id="to-abort", reason="user pressed stop")).found
    tokens, _, complete = collect(stream)
    assert complete.finish_reason == pb.FINISH_REASON_ABORT and complete.abort_message == "user pressed stop"
    assert complete.completion_tokens < 400
    assert len(first.chunk.token_ids) + len(tokens) == complete.completion_tokens
    server.wait_idle()
    assert server.on_engine(lambda core: core.scheduler.kv.num_free_blocks) == 512  # num_kv_blocks: all free
    assert not server.stub.Abort(pb.AbortRequest(request_id="to-abort")).found


def test_a_client_that_goes_away_releases_its_request(server):
    call = server.stub.Generate(generate_request("gone", _prompt(5, 30), max_new_tokens=400), timeout=60)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as failure:
        list(call)
    assert failure.value.code() == grpc.StatusCode.CANCELLED
    server.wait_idle()
    assert server.on_engine(lambda core: core.scheduler.num_running + core.scheduler.num_waiting) == 0


def test_a_deadline_cancels_generation_on_the_server(server):
    with pytest.raises(grpc.RpcError) as failure:
        collect(server.stub.Generate(generate_request("slow", _prompt(6, 30), max_new_tokens=450), timeout=0.5))
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()
    assert server.on_engine(lambda core: core.scheduler.kv.usage) == 0.0


def test_a_duplicate_live_request_id_is_refused(server):
    first = server.stub.Generate(generate_request("dup", _prompt(7, 20), max_new_tokens=300), timeout=60)
    next(first)
    with pytest.raises(grpc.RpcError) as failure:
        collect(server.stub.Generate(generate_request("dup", _prompt(8, 20))))
    assert failure.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    server.wait_idle()


def test_logprobs_travel_with_the_tokens(server):
    tokens, chunks, _ = collect(
        server.stub.Generate(generate_request("lp", _prompt(9, 20), 4, logprobs=True, top_logprobs=3))
    )
    logprobs = [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert len(logprobs) == len(tops) == len(tokens) == 4
    for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
        assert len(top.token_ids) == 3 and top.token_ids[0] == token  # greedy: the chosen token is the top one
        assert logprob == pytest.approx(top.logprobs[0]) and logprob <= 0
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)


def test_a_stop_token_ends_with_stop_and_is_not_streamed(server):
    prompt = _prompt(10, 25)
    free_run, _, _ = collect(server.stub.Generate(generate_request("free", prompt, 6)))
    stop_at = free_run[3]
    tokens, _, complete = collect(
        server.stub.Generate(generate_request("stopped", prompt, 6, stop_token_ids=[stop_at]))
    )
    first_stop = free_run.index(stop_at)
    assert tokens == free_run[:first_stop]
    assert complete.finish_reason == pb.FINISH_REASON_STOP and complete.matched_stop_token_id == stop_at


def test_health_services_and_loads(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "m3stack.engine.v1.Engine"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    deep = server.stub.HealthCheck(pb.HealthCheckRequest(), timeout=30)
    assert deep.healthy and deep.message == "ok" and deep.latency_ms > 0
    loads = server.stub.GetLoads(pb.GetLoadsRequest())
    assert loads.max_num_running == 40 and not loads.draining
    assert 0.0 <= loads.prefix_hit_rate <= 1.0


def test_loads_see_running_requests_and_metrics_see_latencies(server):
    stream = server.stub.Generate(generate_request("busy", _prompt(11, 30), max_new_tokens=300), timeout=60)
    next(stream)
    loads = server.stub.GetLoads(pb.GetLoadsRequest())
    assert loads.num_running == 1 and loads.kv_usage > 0 and loads.num_used_tokens >= 16
    stream.cancel()
    server.wait_idle()
    samples = scrape(f"{server.metrics_url}/metrics")
    labels = {"model_name": server.core.info.served_model_name, "engine": "0"}
    assert total(samples, "vllm:time_to_first_token_seconds_count", **labels) >= 1
    assert total(samples, "vllm:inter_token_latency_seconds_count", **labels) >= 1
    assert total(samples, "vllm:request_success_total", finished_reason="abort", **labels) >= 1
    assert total(samples, "vllm:prefix_cache_queries_total", **labels) > 0
    assert samples[("vllm:num_requests_running", tuple(sorted(labels.items())))] == 0
    for probe in ("loaded", "ready", "health"):
        assert urllib.request.urlopen(f"{server.metrics_url}/{probe}", timeout=10).status == 200


def test_a_full_queue_answers_resource_exhausted(make_server):
    small = make_server(max_num_seqs=1, max_queue=1)
    running = small.stub.Generate(generate_request("q-run", _prompt(12, 20), max_new_tokens=400), timeout=60)
    next(running)
    waiting = small.stub.Generate(generate_request("q-wait", _prompt(13, 20), max_new_tokens=2), timeout=60)
    waiter = threading.Thread(target=lambda: collect(waiting))
    waiter.start()
    deadline = time.monotonic() + 10
    while small.stub.GetLoads(pb.GetLoadsRequest()).num_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as failure:
        collect(small.stub.Generate(generate_request("q-over", _prompt(14, 20))))
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in failure.value.details()
    running.cancel()
    waiter.join(30)
    small.wait_idle()


def test_drain_finishes_short_work_aborts_the_rest_and_refuses_new_requests(make_server):
    draining = make_server()
    # Long enough to outlive the wait below and the drain on a loaded machine (480 tokens once finished inside
    # the 2 s drain on CI while the short request's thread was slow to start: nothing left to abort).
    long_call = draining.stub.Generate(generate_request("long", _prompt(15, 20), max_new_tokens=4000), timeout=60)
    next(long_call)
    short_result = []
    short = threading.Thread(
        target=lambda: short_result.append(
            collect(draining.stub.Generate(generate_request("short", _prompt(16, 9), 3)))
        )
    )
    short.start()
    deadline = time.monotonic() + 10
    while draining.stub.GetLoads(pb.GetLoadsRequest()).num_running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    aborted = draining.run(draining.server.drain(2.0))
    short.join(30)
    assert aborted == 1
    assert short_result[0][2].finish_reason == pb.FINISH_REASON_LENGTH  # in-flight work finished
    _, _, complete = collect(long_call)
    assert complete.finish_reason == pb.FINISH_REASON_ABORT and "drain" in complete.abort_message
    with pytest.raises(grpc.RpcError) as failure:
        collect(draining.stub.Generate(generate_request("late", _prompt(17, 5))))
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(draining.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert draining.stub.GetLoads(pb.GetLoadsRequest()).draining
    assert not draining.stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    draining.wait_idle()
