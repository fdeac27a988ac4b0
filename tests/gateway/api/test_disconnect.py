"""A client that goes away aborts its engine request: visible in the engine's own metrics."""

import json
import threading

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("gateway_api")

ABORTED = ("m3stack_engine_requests_finished_total", (("reason", "abort"),))
RUNNING = ("m3stack_engine_requests_running", ())


def long_request(model_name: str, stream: bool) -> bytes:
    body = {"model": model_name, "prompt": "Count forever:", "max_tokens": 240, "stream": stream, "ignore_eos": True}
    return json.dumps(body).encode()


def gateway_inflight(gateway, engine) -> float:
    return gateway.metrics()[("m3stack_gateway_engine_inflight_requests", (("engine", engine.address),))]


def test_closing_a_stream_aborts_the_engine_request(gateway, engine, model_name, wait_until):
    aborted_before = engine.metrics().get(ABORTED, 0.0)
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
    wait_until(lambda: engine.metrics().get(ABORTED, 0.0) == aborted_before + 1, 30, "the engine to abort")
    wait_until(lambda: engine.metrics()[RUNNING] == 0 and gateway_inflight(gateway, engine) == 0, 30, "no request left")
    reasons = gateway.metrics()
    assert reasons[("m3stack_gateway_engine_aborts_total", (("reason", "client_disconnected"),))] >= 1


def test_leaving_a_non_streamed_request_aborts_it_too(gateway, engine, model_name, wait_until):
    aborted_before = engine.metrics().get(ABORTED, 0.0)
    started = threading.Event()

    def impatient_client() -> None:
        started.set()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gateway.base_url}/v1/completions",
                content=long_request(model_name, False),
                headers={"Content-Type": "application/json"},
                timeout=httpx.Timeout(60, read=1.5),
            )

    thread = threading.Thread(target=impatient_client)
    thread.start()
    started.wait()
    wait_until(lambda: gateway_inflight(gateway, engine) == 1, 30, "the request to reach the engine")
    thread.join(timeout=60)
    wait_until(lambda: engine.metrics().get(ABORTED, 0.0) == aborted_before + 1, 30, "the engine to abort")
    wait_until(lambda: gateway_inflight(gateway, engine) == 0, 30, "the gateway to let go")
