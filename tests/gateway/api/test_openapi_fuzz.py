"""Schemathesis against the gateway's OpenAPI document: no generated request gets a 5xx.

Media input is off in this gateway so that generated image/video URLs are never fetched (tests talk
to loopback only); choices and tokens are capped so the CPU engine keeps up.
"""

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.serving import total

pytestmark = pytest.mark.xdist_group("gateway_api")

MAX_CHOICES = 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def fuzz_gateway(stack, engine):
    return stack.gateway([engine], "--media-workers", "0")


def bound_the_work(case, model_name: str) -> None:
    """Name the served model (an unknown one is a 404 before anything else runs; its own test covers
    that) and cap the work the engine does.  The caps keep a valid request valid: ``best_of`` (which must
    equal ``n``) and ``min_tokens`` (at most the maximum) are capped with what they are held to."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model_name
    for keys, cap in (
        (("n", "best_of"), MAX_CHOICES),
        (("max_tokens", "max_completion_tokens", "min_tokens"), MAX_TOKENS),
    ):
        for key in keys:
            # A JSON integer may come as 3.0 (the server takes it as 3).
            if isinstance(body.get(key), int | float) and not isinstance(body[key], bool) and body[key] > cap:
                body[key] = cap
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > MAX_CHOICES:
        body["prompt"] = body["prompt"][:MAX_CHOICES]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_no_request_gets_a_server_error(fuzz_gateway, model_name):
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for operation in operations:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case) -> None:
            bound_the_work(case, model_name)
            case.call_and_validate(checks=CHECKS, timeout=120)

        call()
    # The fuzzing reached the engines, not only the validation in front of them.
    served = fuzz_gateway.metrics()
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        assert total(served, "m3stack_gateway_requests_total", endpoint=endpoint, status="200") > 0


# Bodies the gateway refuses by a check of its own (not a pydantic constraint): the document says so too, so a
# client generated from it never writes them.  (path, change to a valid body, param of the 400)
REFUSED_BY_A_CHECK = [
    ("/v1/chat/completions", {"stop": ""}, "stop"),
    ("/v1/chat/completions", {"stop": ["a", ""]}, "stop"),
    ("/v1/chat/completions", {"logit_bias": {"one": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1": 100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
]  # fmt: skip
VALID_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/detokenize": {"tokens": [1]},
}


def assert_refused_by_document_and_gateway(gateway, model_name: str, path: str, change: dict, param: str) -> None:
    document = httpx.get(f"{gateway.base_url}/openapi.json", timeout=30).json()
    body = {"model": model_name, **VALID_BODIES[path], **change}
    operation = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**operation, "components": document["components"]})
    assert validator.is_valid({"model": model_name, **VALID_BODIES[path]}), path
    assert not validator.is_valid(body), (path, change)
    response = httpx.post(f"{gateway.base_url}{path}", json=body, timeout=60)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), (change, response.text)


def test_the_document_refuses_what_a_gateway_check_refuses(fuzz_gateway, model_name):
    for path, change, param in REFUSED_BY_A_CHECK:
        assert_refused_by_document_and_gateway(fuzz_gateway, model_name, path, change, param)


def test_the_document_bounds_token_ids_by_the_served_vocabulary(fuzz_gateway, model_name, tokenizer):
    """The gateway refuses a token id outside its model's vocabulary; its document says so, and takes the last one."""
    vocab = tokenizer.vocab_size
    for path, field, outside, inside in [
        ("/v1/completions", "prompt", [1, vocab], [1, vocab - 1]),
        ("/v1/completions", "prompt", [[1], [vocab]], [[1], [vocab - 1]]),
        ("/v1/completions", "stop_token_ids", [vocab], [vocab - 1]),
        ("/v1/chat/completions", "stop_token_ids", [vocab], [vocab - 1]),
        ("/v1/chat/completions", "logit_bias", {str(vocab): 1}, {str(vocab - 1): 1}),
        ("/v1/completions", "logit_bias", {str(10 * vocab): 1}, {"0": 1}),
        ("/detokenize", "tokens", [vocab], [vocab - 1]),
    ]:
        assert_refused_by_document_and_gateway(fuzz_gateway, model_name, path, {field: outside}, field)
        body = {"model": model_name, **VALID_BODIES[path], field: inside}
        assert httpx.post(f"{fuzz_gateway.base_url}{path}", json=body, timeout=60).status_code == 200, (path, body)
