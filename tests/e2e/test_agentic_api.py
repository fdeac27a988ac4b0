"""The agentic API end to end against ``m3stack up`` (an engine and a gateway on loopback, the tiny random-weight
model): the official ``openai`` client and LangChain's ``ChatOpenAI``.  Forced tool calls and JSON output come from
constrained decoding in the engine, so they parse and validate whatever the weights are; reasoning is split where
the model closed its think block; a key over its limit gets a 429 with Retry-After.

Every test takes a key of its own (``api_key``): the per-key limits of this stack never cross tests."""

import concurrent.futures
import itertools
import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from m3stack.local.stack import LocalStack
from tests.e2e.conftest import start_stack

pytestmark = pytest.mark.xdist_group("e2e_agentic")

KEYS = [f"agentic-key-{i}" for i in range(40)]
RATE_LIMITS = ("--rate-limit-rps", "4", "--rate-limit-concurrency", "2")
CONTEXT = 4096
MAX_TOKENS = 400
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8, "description": "City name"},
        "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["city", "days"],
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 10}, "score": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}  # fmt: skip


class GetWeather(BaseModel):
    """Get the weather in a city."""

    city: str = Field(max_length=8, description="City name")
    days: int = Field(description="Days ahead")
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def agentic_stack(tiny_model_dir, tmp_path_factory) -> Iterator[LocalStack]:
    folder = tmp_path_factory.mktemp("agentic-stack")
    keys = folder / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    gateway_args = ("--api-key-file", str(keys), *RATE_LIMITS)
    running = start_stack(tiny_model_dir, folder, 1, ("--max-model-len", str(CONTEXT)), gateway_args)
    try:
        yield running
    finally:
        running.stop()


_unused_keys = itertools.count()


@pytest.fixture
def api_key() -> str:
    return KEYS[next(_unused_keys)]


class Client:
    """The official client on one key, asking about the weather with the stack's model."""

    def __init__(self, stack: LocalStack, api_key: str) -> None:
        self.openai = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
        self.model = stack.served_model_name

    def create(self, **body):
        return self.openai.chat.completions.create(
            model=self.model, messages=MESSAGES, **{"max_tokens": MAX_TOKENS, "temperature": 1.0, **body}
        )


@pytest.fixture
def client(agentic_stack, api_key) -> Client:
    return Client(agentic_stack, api_key)


def streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """The tool calls of a stream as OpenAI clients assemble them, its finish reason and its content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                # The first piece of a call names it: id, type and function name.
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish, content


def assert_valid_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", [1, 2])
def test_a_named_tool_choice_returns_a_valid_call(client, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.create(tools=TOOLS, tool_choice=choice, seed=seed)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0].id.startswith("call_")
    assert_valid_calls([(c.function.name, c.function.arguments) for c in message.tool_calls], {"get_weather"})

    calls, finish, content = streamed_calls(client.create(tools=TOOLS, tool_choice=choice, seed=seed, stream=True))
    assert finish == "tool_calls" and content == ""
    # The same seed samples the same tokens: the stream assembles to the same call.
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_required_tool_choice_returns_valid_calls_of_any_tool(client):
    for seed in (3, 4):
        response = client.create(tools=TOOLS, tool_choice="required", seed=seed)
        calls = response.choices[0].message.tool_calls
        assert_valid_calls([(c.function.name, c.function.arguments) for c in calls], {"get_weather", "search"})
        streamed, finish, _ = streamed_calls(client.create(tools=TOOLS, tool_choice="required", seed=seed, stream=True))
        assert finish == "tool_calls"
        assert_valid_calls([(c["name"], c["arguments"]) for c in streamed.values()], {"get_weather", "search"})


def test_one_call_when_parallel_calls_are_off(client):
    response = client.create(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=5)
    assert len(response.choices[0].message.tool_calls) == 1


def test_auto_and_none_leave_random_text_as_content(client):
    for tool_choice in ("auto", "none"):
        response = client.create(tools=TOOLS, tool_choice=tool_choice, seed=6, max_tokens=16)
        choice = response.choices[0]
        assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for seed in (7, 8):
        response = client.create(response_format=response_format, seed=seed, stream=stream)
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
        else:
            assert response.choices[0].finish_reason == "stop"
            text = response.choices[0].message.content
        jsonschema.validate(json.loads(text), ANSWER)


def test_json_object_output_is_an_object(client):
    response = client.create(response_format={"type": "json_object"}, seed=9, max_tokens=1500)
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_a_schema_llguidance_cannot_enforce_is_a_400_naming_it(client):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.create(response_format=response_format)
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "if" in caught.value.body["message"] and "then" in caught.value.body["message"]


def token_id(stack: LocalStack, api_key: str, text: str) -> int:
    response = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                          headers={"Authorization": f"Bearer {api_key}"}, timeout=60)  # fmt: skip
    response.raise_for_status()
    (token,) = response.json()["tokens"]
    return token


def test_reasoning_is_split_where_the_model_closed_its_think_block(agentic_stack, api_key, client):
    think_close = token_id(agentic_stack, api_key, "</mm:think>")
    body = {
        "seed": 10,
        "max_tokens": 40,
        "logprobs": True,
        # Thinking on: the template opens the think block; a bias makes the random model close it early.
        "logit_bias": {str(think_close): 6.0},
        "extra_body": {"chat_template_kwargs": {"thinking_mode": "enabled"}, "return_tokens_as_token_ids": True},
    }
    response = client.create(**body)
    choice = response.choices[0]
    ids = [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]
    assert think_close in ids
    cut = ids.index(think_close)
    hf = AutoTokenizer.from_pretrained(agentic_stack.model_dir)
    assert choice.message.reasoning_content == (hf.decode(ids[:cut], skip_special_tokens=True) or None)
    assert choice.message.content == hf.decode(ids[cut + 1 :], skip_special_tokens=True)
    # vLLM's name for the same text, beside the reference stacks'.
    assert choice.message.model_extra["reasoning"] == choice.message.reasoning_content

    reasoning = vllm_reasoning = content = ""
    for chunk in client.create(**body, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        vllm_reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
    assert (reasoning or None, content) == (choice.message.reasoning_content, choice.message.content)
    assert vllm_reasoning == reasoning


def test_thinking_off_per_request_renders_a_closed_think_block(agentic_stack, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}, "return_token_strs": True}
    tokens = httpx.post(f"{agentic_stack.base_url}/tokenize", json=body, headers=headers, timeout=60).json()
    assert tokens["token_strs"][-1] == "</mm:think>" and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == CONTEXT
    text = httpx.post(f"{agentic_stack.base_url}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers,
                      timeout=60).json()["prompt"]  # fmt: skip
    assert text.endswith("]~b]user\nWhat is the weather in Paris?[e~[\n]~b]ai\n</mm:think>")
    bad = httpx.post(f"{agentic_stack.base_url}/detokenize", json={"tokens": [10**9]}, headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def chat_model(stack: LocalStack, api_key: str, seed: int) -> ChatOpenAI:
    return ChatOpenAI(model=stack.served_model_name, base_url=f"{stack.base_url}/v1", api_key=api_key,
                      temperature=1.0, max_tokens=MAX_TOKENS, seed=seed, max_retries=0, timeout=300)  # fmt: skip


def test_langchain_bind_tools_with_a_forced_tool(agentic_stack, api_key):
    bound = chat_model(agentic_stack, api_key, 11).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather" and not message.invalid_tool_calls
    GetWeather.model_validate(call["args"])

    streamed = None
    for chunk in bound.stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [call["args"]]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(agentic_stack, api_key, method):
    structured = chat_model(agentic_stack, api_key, 12).with_structured_output(GetWeather, method=method)
    result = structured.invoke("What is the weather in Paris?")
    assert isinstance(result, GetWeather)


def test_a_key_over_its_limits_gets_429_with_retry_after(agentic_stack, api_key):
    body = {"model": agentic_stack.served_model_name, "messages": MESSAGES, "max_tokens": 64, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {api_key}"}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{agentic_stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    statuses = sorted(response.status_code for response in responses)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 4, statuses  # at most 2 run at once
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
    # Another key is not held back by this one's limits.
    other = {"Authorization": f"Bearer {KEYS[-1]}"}
    assert httpx.post(f"{agentic_stack.base_url}/v1/chat/completions", json={**body, "max_tokens": 2},
                      headers=other, timeout=300).status_code == 200  # fmt: skip
