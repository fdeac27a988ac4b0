"""A client that goes away aborts its engine request: visible in the engine's own metrics."""

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.serving import StreamRunner, series, total

pytestmark = pytest.mark.xdist_group("gateway_api")


def aborted(engine) -> float:
    return total(engine.metrics(), "vllm:request_success_total", finished_reason="abort")


def running(engine) -> float:
    return total(engine.metrics(), "vllm:num_requests_running")


def long_request(model_name: str, stream: bool) -> bytes:
    body = {"model": model_name, "prompt": "Count forever:", "max_tokens": 240, "stream": stream, "ignore_eos": True}
    return json.dumps(body).encode()


@contextlib.contextmanager
def sent_non_streamed(gateway, model_name: str) -> Iterator[None]:
    """A long non-streamed request on a raw socket, closed when the block ends (an HTTP client's read timeout
    leaves at no chosen moment)."""
    url = httpx.URL(gateway.base_url)
    body = long_request(model_name, False)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((url.host, url.port), timeout=30) as client:
        client.sendall(head.encode() + body)
        yield


def gateway_inflight(gateway, engine, model_name: str) -> float:
    return series(
        gateway.metrics(), "m3stack_gateway_engine_inflight_requests", engine=engine.address, model_name=model_name
    )


def test_closing_a_stream_aborts_the_engine_request(gateway, engine, model_name, wait_until):
    aborted_before = aborted(engine)
    headers = {"Content-Type": "application/json"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{gateway.base_url}/v1/completions", content=long_request(model_name, True), headers=headers
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: {")]
        assert received
    # The connection is closed here, long before 240 tokens.
    wait_until(lambda: aborted(engine) == aborted_before + 1, 30, "the engine to abort")
    wait_until(
        lambda: running(engine) == 0 and gateway_inflight(gateway, engine, model_name) == 0, 30, "no request left"
    )
    reasons = gateway.metrics()
    assert (
        series(reasons, "m3stack_gateway_engine_aborts_total", reason="client_disconnected", model_name=model_name) >= 1
    )


def test_leaving_a_non_streamed_request_aborts_it_too(gateway, engine, model_name, wait_until):
    """The client hangs up as soon as its request runs on the engine (an HTTP client's read timeout left too late
    on a fast machine, after the engine had finished the 240 tokens)."""
    aborted_before = aborted(engine)
    with sent_non_streamed(gateway, model_name):
        wait_until(lambda: gateway_inflight(gateway, engine, model_name) == 1, 30, "the request to reach the engine")
    wait_until(lambda: aborted(engine) == aborted_before + 1, 30, "the engine to abort")
    wait_until(lambda: gateway_inflight(gateway, engine, model_name) == 0, 30, "the gateway to let go")


def test_leaving_before_the_first_token_aborts_the_waiting_request(stack, model_name, wait_until):
    """A client that hangs up while its request still waits for its first token (here in the engine's queue,
    behind a stream on an engine that runs one sequence at a time) aborts it there and then: the engine never
    prefills it.  The gateway used to notice only once the first token came, after the work it no longer needed."""
    engine = stack.engine("--max-num-seqs", "1")
    gateway = stack.gateway([engine], "--media-workers", "0")
    running_stream = StreamRunner(gateway.client(), model_name, "Count forever:", 200)
    running_stream.start()
    wait_until(lambda: running_stream.chunks > 0, 60, "the first stream to run")
    prefilled_before, aborted_before = total(engine.metrics(), "vllm:prompt_tokens_total"), aborted(engine)
    with sent_non_streamed(gateway, model_name):
        wait_until(lambda: total(engine.metrics(), "vllm:num_requests_waiting") == 1, 30, "the request to queue")
    wait_until(lambda: aborted(engine) == aborted_before + 1, 30, "the engine to abort the waiting request")
    running_stream.join(120)
    assert running_stream.error is None and running_stream.finish_reason == "length"
    assert total(engine.metrics(), "vllm:prompt_tokens_total") == prefilled_before
    wait_until(lambda: gateway_inflight(gateway, engine, model_name) == 0, 30, "the gateway to let go")
