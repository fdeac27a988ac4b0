"""Faults in local stacks of two engines and a gateway, started for these tests:

1. SIGKILL one engine mid-stream: its streams end with an error naming it within seconds, the other
   engine's streams finish, new requests go to the survivor;
2. restart it on its old address: the gateway routes to it again;
3. SIGTERM an engine with requests in flight: they all finish before the drain deadline, the engine exits 0,
   requests sent meanwhile go to the other engine;
4. SIGTERM the gateway (on a stack of its own): open streams finish, new connections are refused, the
   gateway exits 0.

The engine tests share one stack, and each first puts the victim engine in the state it needs, so
they hold in any order and on any xdist worker.
"""

import os
import signal
import time

import httpx
import pytest

from m3stack.local.processes import signal_child
from tests.e2e.conftest import ENGINE_READY_TIMEOUT_S, engine_metrics, gateway_metrics, openai_client, start_stack
from tests.helpers.serving import StreamRunner, poll_until, total

pytestmark = pytest.mark.xdist_group("e2e_faults")

PROMPT = "Tell me a long story about engines and gateways."
ENGINE_DRAIN_S = 60.0  # generous: the streams below need a few seconds on an idle machine, far more on a loaded one
ERROR_WITHIN_S = 10.0  # a stream whose engine died ends this soon after the kill
VICTIM = 1  # the engine the faults happen to; engine 0 survives them


@pytest.fixture(scope="module")
def fault_stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(
        tiny_model_dir,
        tmp_path_factory.mktemp("fault-stack-logs"),
        2,
        engine_args=("--drain-timeout", str(ENGINE_DRAIN_S)),
        gateway_args=("--media-workers", "0", "--drain-timeout", "60", "--breaker-open", "1"),
    )
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(fault_stack):
    return openai_client(fault_stack, timeout_s=180)


def gateway_sample(stack, name: str, index: int) -> float:
    return total(gateway_metrics(stack), name, engine=stack.engines[index].address)


def inflight(stack, index: int) -> float:
    return gateway_sample(stack, "m3stack_gateway_engine_inflight_requests", index)


def finished_requests(stack, index: int) -> float:
    return total(engine_metrics(stack, index), "vllm:request_success_total")


def start_streams(client, model: str, count: int, max_tokens: int) -> list[StreamRunner]:
    runners = [StreamRunner(client, model, PROMPT, max_tokens) for _ in range(count)]
    for runner in runners:
        runner.start()
    return runners


def start_streams_on_both_engines(stack, client, model: str, count: int, max_tokens: int) -> list[StreamRunner]:
    """Streams the faults can hit: ``max_tokens`` must keep them open well past the first metrics scrapes (the
    tiny model decodes 64 tokens for 6 streams faster than a loaded machine scrapes the gateway twice)."""
    runners = start_streams(client, model, count, max_tokens)
    poll_until(lambda: inflight(stack, 0) >= 1 and inflight(stack, VICTIM) >= 1, 120, "streams on both engines")
    poll_until(lambda: all(r.chunks >= 2 or not r.is_alive() for r in runners), 120, "tokens on every stream")
    return runners


def victim_running(stack) -> None:
    """(Re)start the victim engine if an earlier test left it stopped, and wait for the gateway to use it."""
    if stack.engines[VICTIM].child.returncode is not None:
        stack.restart_engine(VICTIM, ENGINE_READY_TIMEOUT_S)
    poll_until(lambda: gateway_sample(stack, "m3stack_gateway_engine_ready", VICTIM) == 1, 60, "the gateway to see it")


def join_all(runners: list[StreamRunner], timeout_s: float = 180) -> None:
    for runner in runners:
        runner.join(timeout_s)
        assert not runner.is_alive(), "a stream hung"


def test_killed_engine_ends_its_streams_with_an_error_and_the_survivor_takes_new_requests(fault_stack, client):
    victim_running(fault_stack)
    model, victim = fault_stack.served_model_name, fault_stack.engines[VICTIM]
    runners = start_streams_on_both_engines(fault_stack, client, model, count=6, max_tokens=400)
    on_victim = inflight(fault_stack, VICTIM)
    killed_at = time.monotonic()
    signal_child(victim.child, signal.SIGKILL)
    victim.child.popen.wait(30)
    join_all(runners)

    failed = [r for r in runners if r.error is not None]
    assert len(failed) == on_victim, "exactly the streams on the killed engine fail"
    for runner in failed:
        assert victim.address in str(runner.error), str(runner.error)
        assert runner.ended_at - killed_at < ERROR_WITHIN_S
    survivors = [r for r in runners if r.error is None]
    assert survivors and all(r.finish_reason == "length" for r in survivors)

    before = finished_requests(fault_stack, 0)
    for _ in range(4):
        response = client.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 3
    assert finished_requests(fault_stack, 0) - before == 4
    assert gateway_sample(fault_stack, "m3stack_gateway_engine_ready", VICTIM) == 0


def test_restarted_engine_is_used_again(fault_stack, client):
    victim = fault_stack.engines[VICTIM].child
    if victim.returncode is None:
        signal_child(victim, signal.SIGKILL)
        victim.popen.wait(30)
    poll_until(
        lambda: gateway_sample(fault_stack, "m3stack_gateway_engine_ready", VICTIM) == 0, 60, "the gateway to drop it"
    )
    victim_running(fault_stack)
    survivor_before = finished_requests(fault_stack, 0)
    # Whether they overlap in time does not matter here, only that both engines serve some of them.
    runners = start_streams(client, fault_stack.served_model_name, 6, max_tokens=64)
    join_all(runners)
    assert all(r.error is None and r.finish_reason == "length" for r in runners), [str(r.error) for r in runners]
    assert finished_requests(fault_stack, VICTIM) >= 1  # a fresh process: it counts from zero
    assert finished_requests(fault_stack, 0) - survivor_before >= 1


def test_sigterm_lets_an_engine_finish_its_requests_within_the_drain_deadline(fault_stack, client):
    victim_running(fault_stack)
    model, victim = fault_stack.served_model_name, fault_stack.engines[VICTIM]
    runners = start_streams(client, model, count=6, max_tokens=320)
    # SIGTERM as soon as the victim has requests: waiting for tokens on every stream first would let the tiny
    # model finish the victim's before the signal.
    poll_until(lambda: inflight(fault_stack, VICTIM) >= 1, 120, "streams on the victim")
    terminated_at = time.monotonic()
    os.kill(victim.child.pid, signal.SIGTERM)
    # Sent while the victim drains: it refuses, and the gateway retries on the other engine before any token.
    response = client.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3
    join_all(runners)
    assert all(r.error is None and r.finish_reason == "length" for r in runners), [str(r.error) for r in runners]
    assert all(r.ended_at - terminated_at < ENGINE_DRAIN_S for r in runners)
    assert victim.child.popen.wait(ENGINE_DRAIN_S + 30) == 0
    assert "draining" in victim.child.log_path.read_text()


@pytest.fixture
def gateway_stack(tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("gateway-stack-logs"), 1,
                        gateway_args=("--media-workers", "0", "--drain-timeout", "60"))  # fmt: skip
    try:
        yield stack
    finally:
        stack.stop()


def test_sigterm_to_the_gateway_finishes_open_streams_and_refuses_new_connections(gateway_stack):
    gateway, client = gateway_stack.gateway, openai_client(gateway_stack, timeout_s=180)
    runners = [StreamRunner(client, gateway_stack.served_model_name, PROMPT, 128) for _ in range(4)]
    for runner in runners:
        runner.start()
    poll_until(lambda: all(r.chunks >= 2 for r in runners), 120, "tokens on every stream")
    os.kill(gateway.pid, signal.SIGTERM)

    def refused() -> bool:
        try:
            httpx.get(f"{gateway_stack.base_url}/health", timeout=2)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # A connection the kernel queued just before the listener closed is reset, never served: refused too
            # (a clean-clone CI run on 2026-12-04 got 'Connection reset by peer' here).
            return True
        return False

    poll_until(refused, 10, "new connections to be refused")
    assert any(r.is_alive() for r in runners), "the streams should still be open when new connections are refused"
    join_all(runners)
    assert all(r.error is None and r.finish_reason == "length" for r in runners), [str(r.error) for r in runners]
    assert gateway.popen.wait(60) == 0
