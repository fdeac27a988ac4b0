"""Schemathesis against the gateway's OpenAPI document: no generated request gets a 5xx.

Media input is off in this gateway so that generated image/video URLs are never fetched (tests talk
to loopback only); choices and tokens are capped so the CPU engine keeps up.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.xdist_group("gateway_api")

MAX_CHOICES = 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def fuzz_gateway(stack, engine):
    return stack.gateway([engine], "--media-workers", "0")


def bound_the_work(case, model_name: str) -> None:
    """Name the served model (an unknown one is a 404 before anything else runs; its own test covers
    that) and cap the work the engine does."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model_name
    if isinstance(body.get("n"), int) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
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
        assert served.get(("m3stack_gateway_requests_total", (("endpoint", endpoint), ("status", "200"))), 0) > 0
