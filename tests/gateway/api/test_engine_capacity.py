"""An engine out of capacity (its waiting queue full) is a 503 with Retry-After through a real gateway, never a bare
error; the requests it did take complete."""

import concurrent.futures

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("gateway_api")


def test_a_full_engine_queue_is_a_503_with_retry_after(stack, model_name):
    engine = stack.engine("--max-num-seqs", "1", "--max-queue", "1")
    gateway = stack.gateway([engine], "--media-workers", "0")
    body = {"model": model_name, "prompt": "hi", "max_tokens": 48, "ignore_eos": True}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    refused = [response for response in responses if response.status_code == 503]
    served = [response for response in responses if response.status_code == 200]
    assert len(refused) + len(served) == 6 and refused and served, [r.status_code for r in responses]
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and "RESOURCE_EXHAUSTED" in error["message"]
    assert all(response.json()["usage"]["completion_tokens"] == 48 for response in served)
