"""Every error class the API promises, in OpenAI's shape and with the right status."""

import json

import httpx
import openai
import pytest

from m3stack.local.processes import free_port

pytestmark = pytest.mark.xdist_group("gateway_api")

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def post(gateway, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{gateway.base_url}{path}", content=content, headers=headers, timeout=60)


def test_bad_json_is_a_400(gateway):
    error = assert_openai_error(
        post(gateway, "/v1/chat/completions", b'{"model": "x", "messages": ['), 400, "invalid_json"
    )
    assert error["type"] == "invalid_request_error"


def test_a_valid_body_not_sent_as_json_is_a_400(gateway, model_name):
    # FastAPI reads a body as JSON only under a JSON content type; the completion fast path must not read more.
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    assert post(gateway, "/v1/completions", body).status_code == 200
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": ""}):
        assert_openai_error(post(gateway, "/v1/completions", body, headers), 400)


def test_invalid_unicode_is_a_400(gateway, model_name):
    # A lone surrogate is valid JSON but not valid text.
    body = b'{"model": "%s", "prompt": "abc \\ud800 def"}' % model_name.encode()
    error = assert_openai_error(post(gateway, "/v1/completions", body), 400, param="prompt")
    assert error["message"] == "prompt holds a lone surrogate (\\ud800), which is not a Unicode character"
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % model_name.encode()
    error = assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, param="messages")
    assert error["message"] == "messages holds a lone surrogate (\\udfff), which is not a Unicode character"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "\xff\xfe"}',  # not UTF-8
        b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than the parser goes
        b'{"model": "m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # more digits than Python converts
    ],
    ids=["not-utf8", "too-deep", "too-many-digits"],
)
def test_a_body_that_cannot_be_parsed_is_invalid_json(gateway, body):
    assert_openai_error(post(gateway, "/v1/completions", body), 400, "invalid_json")


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("override", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        # Positive, but 0 as the float32 the engines receive: the gateway refuses it, not the engine.
        ({"top_p": 1e-300}, "top_p"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"logit_bias": {"1000000": 5}}, "logit_bias"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
        ),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_invalid_parameters_are_a_400_naming_the_field(gateway, model_name, override, param):
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 4, **override}
    assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, param=param)


def test_unsupported_completion_options_are_a_400(gateway, model_name):
    for override, param in (
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    ):
        body = {"model": model_name, "prompt": "hi", "max_tokens": 2, **override}
        assert_openai_error(post(gateway, "/v1/completions", body), 400, "unsupported_parameter", param)


def test_out_of_vocabulary_prompt_ids_are_a_400(gateway, model_name):
    assert_openai_error(
        post(gateway, "/v1/completions", {"model": model_name, "prompt": [1, 10**6]}), 400, param="prompt"
    )


def test_prompts_too_long_for_the_context_are_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="word " * 400, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded" and "256" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="short", max_tokens=300)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "max_tokens"


def test_invalid_media_is_a_400_pointing_at_the_part(gateway, model_name):
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    body = {"model": model_name, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, param="messages[0].content[1]")


def test_unknown_paths_and_methods_answer_in_the_openai_shape(gateway):
    assert_openai_error(httpx.get(f"{gateway.base_url}/v1/nothing-here"), 404, "not_found")
    assert_openai_error(httpx.get(f"{gateway.base_url}/v1/chat/completions"), 405, "method_not_allowed")


@pytest.fixture(scope="module")
def guarded_gateway(stack, engine, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("first-key\nsecond-key\n")
    return stack.gateway([engine], "--api-key-file", str(keys), "--max-request-bytes", "2048", "--media-workers", "0")


def test_api_keys_are_checked_and_probes_stay_open(guarded_gateway, model_name):
    with pytest.raises(openai.AuthenticationError):
        guarded_gateway.client(api_key="wrong").models.list()
    for headers in ({}, {"Authorization": "Basic Zmlyc3Qta2V5"}, {"Authorization": "Bearer"}):
        response = httpx.get(f"{guarded_gateway.base_url}/v1/models", headers=headers)
        assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert [m.id for m in guarded_gateway.client(api_key="second-key").models.list().data] == [model_name]
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{guarded_gateway.base_url}{probe}").status_code == 200


def test_oversized_bodies_are_a_413(guarded_gateway, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "x" * 4000}]}
    headers = {"Authorization": "Bearer first-key"}
    assert_openai_error(post(guarded_gateway, "/v1/chat/completions", body, headers), 413, "request_too_large")

    def chunked():  # no Content-Length: the cap applies while reading
        yield json.dumps(body).encode()

    response = httpx.post(
        f"{guarded_gateway.base_url}/v1/chat/completions",
        content=chunked(),
        headers={"Content-Type": "application/json", **headers},
    )
    assert_openai_error(response, 413, "request_too_large")


def test_no_engine_is_a_503_with_retry_after(stack, model_name):
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    gateway = stack.gateway(None, "--engines", nowhere, "--media-workers", "0", wait_ready=False)
    assert httpx.get(f"{gateway.base_url}/ready").status_code == 503
    response = post(gateway, "/v1/chat/completions", {"model": model_name, "messages": MESSAGES})
    error = assert_openai_error(response, 503, "engine_unavailable")
    assert error["type"] == "server_error"
    assert int(response.headers["Retry-After"]) >= 1
    with pytest.raises(openai.InternalServerError) as caught:
        gateway.client().completions.create(model=model_name, prompt="hi")
    assert caught.value.status_code == 503
