"""Server-sent events stay one event per line for clients that split the body with ``str.splitlines()``
(guidellm's OpenAI backend does): U+0085, U+2028 and U+2029 in an echoed prompt must not reach the wire raw."""

import json

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("gateway_api")

# The three that JSON encoders leave raw, plus the rest of what splitlines() splits on.
PROMPT = "one\u2028two\u2029three\x85four\x0bfive\x0csix\x1cseven\x1deight\x1enine"


def test_a_streamed_echo_splits_into_whole_events_with_splitlines(gateway, model_name):
    body = {"model": model_name, "prompt": PROMPT, "echo": True, "stream": True, "max_tokens": 3}
    with httpx.Client(timeout=60) as http:
        response = http.post(f"{gateway.base_url}/v1/completions", json=body)
    assert response.status_code == 200
    raw = response.content
    for char in "\x85\u2028\u2029\x0b\x0c\x1c\x1d\x1e":
        assert char.encode() not in raw, f"U+{ord(char):04X} is raw in the stream"
    lines = [line for line in raw.decode().splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text.startswith(PROMPT) and chunks[-1]["choices"][0]["finish_reason"] == "length"
