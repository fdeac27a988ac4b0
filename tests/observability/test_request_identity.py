"""x-request-id from the client to every log line of the request, in the gateway and in the engine, and the
gateway's JSON access log: one line per request, with its status, tokens, duration and API key id."""

import hashlib
import re
import uuid

import httpx
import pytest

from tests.helpers.serving import poll_until
from tests.observability.conftest import API_KEY, ObservedStack, Process

pytestmark = pytest.mark.xdist_group("observability")


def chat(stack: ObservedStack, gateway: Process, headers: dict[str, str], **body: object) -> httpx.Response:
    payload = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        **body,
    }
    auth = {"Authorization": f"Bearer {API_KEY}"} if gateway is stack.gateway else {}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, headers={**auth, **headers}, timeout=120)


def access_lines(gateway: Process, request_id: str) -> list[dict]:
    return [e for e in gateway.json_lines() if e.get("type") == "access" and e["request_id"] == request_id]


def one_access_line(gateway: Process, request_id: str) -> dict:
    lines = poll_until(lambda: access_lines(gateway, request_id), 10, f"the access line of {request_id}")
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("which", ["gateway", "request_gateway"])
def test_a_client_request_id_is_returned_and_on_every_log_line_of_the_request(observed_stack, which):
    gateway = getattr(observed_stack, which)
    request_id = f"client-{uuid.uuid4().hex[:12]}"
    response = chat(observed_stack, gateway, {"x-request-id": request_id})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    completion_id = response.json()["id"]  # the engine requests are <id>-<choice>

    # The gateway (text format): every line naming the request's engine requests carries its context.
    gateway_lines = [line for line in gateway.log_lines() if completion_id in line and not line.startswith("{")]
    assert gateway_lines, "the gateway logged nothing about the request at DEBUG"
    assert all(f"[request {request_id}]" in line for line in gateway_lines), gateway_lines

    # The engine (JSON format): admission (in the request's gRPC context) and the end (on the engine thread).
    def engine_entries() -> list[dict]:
        return [e for e in observed_stack.engine.json_lines() if completion_id in e.get("message", "")]

    entries = poll_until(lambda: len(engine_entries()) >= 2 and engine_entries(), 10, "the engine's request lines")
    assert all(entry.get("request_id") == request_id for entry in entries), entries
    messages = " | ".join(entry["message"] for entry in entries)
    assert "admitting" in messages and "finished" in messages and "(length)" in messages


def test_without_a_request_id_the_gateway_makes_one_and_logs_the_access(observed_stack):
    response = chat(observed_stack, observed_stack.gateway, {})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    line = one_access_line(observed_stack.gateway, request_id)
    usage = response.json()["usage"]
    assert line["status"] == 200 and line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["completion_tokens"] == usage["completion_tokens"]
    assert line["completion_tokens"] == 5 and line["model"] == observed_stack.model_name and line["stream"] is False
    assert 0 < line["duration_s"] < 120 and line["client"] == "127.0.0.1"
    # The key's id, never the key.
    assert line["api_key_id"] == hashlib.sha256(API_KEY.encode()).hexdigest()[:16]
    assert API_KEY not in observed_stack.gateway.child.log_path.read_text()


def test_a_stream_is_logged_once_it_has_ended_with_its_tokens(observed_stack):
    request_id = f"stream-{uuid.uuid4().hex[:8]}"
    client = observed_stack.client().with_options(default_headers={"x-request-id": request_id})
    chunks = list(
        client.chat.completions.create(
            model=observed_stack.model_name,
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    line = one_access_line(observed_stack.gateway, request_id)
    assert line["stream"] is True and line["status"] == 200
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert line["completion_tokens"] == 7 and line["prompt_tokens"] > 0


def test_refused_requests_get_an_access_line_and_their_id_back(observed_stack):
    request_id = f"nokey-{uuid.uuid4().hex[:8]}"
    response = httpx.post(
        f"{observed_stack.gateway.url}/v1/chat/completions", json={}, headers={"x-request-id": request_id}, timeout=30
    )
    assert response.status_code == 401 and response.headers["x-request-id"] == request_id
    line = one_access_line(observed_stack.gateway, request_id)
    assert line["status"] == 401 and line["api_key_id"] is None and line["prompt_tokens"] is None


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "é"])
def test_a_malformed_request_id_is_a_400_naming_the_header(observed_stack, bad):
    response = httpx.post(
        f"{observed_stack.request_gateway.url}/v1/chat/completions",
        json={},
        headers={"x-request-id": bad.encode()},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "x-request-id" and "x-request-id must be 1 to 128 visible ASCII" in error["message"]
