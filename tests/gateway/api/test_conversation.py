"""Conversations that cannot be valid are a 400 naming the field, as OpenAI's API answers them; pydantic union
failures are described in plain words.  The rules table runs on the pure check; the HTTP cases go through the
real gateway with the openai client."""

import itertools

import httpx
import jsonschema
import openai
import pytest

from m3stack.gateway.api.conversation import check_conversation
from m3stack.gateway.errors import APIError
from m3stack.gateway.schemas import ChatCompletionRequest

pytestmark = pytest.mark.xdist_group("gateway_api")

USER = {"role": "user", "content": "What is the weather in Paris and Rome?"}
CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
    ],
}
ANSWER_1 = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
ANSWER_2 = {"role": "tool", "tool_call_id": "call_2", "content": "24 C"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

VALID = [
    [USER],
    [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Sure."}, USER],
    [USER, CALLS, ANSWER_1, ANSWER_2],
    [USER, CALLS, ANSWER_2, ANSWER_1, {"role": "assistant", "content": "Warm."}, USER],
    [USER, {**CALLS, "content": "Let me check."}, ANSWER_1, ANSWER_2],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}],
    [{"role": "assistant", "content": ""}, USER],
]

# (conversation, param, words the message must hold)
INVALID = [
    ([USER, CALLS, {"role": "tool", "content": "18 C"}, ANSWER_2], "messages[2].tool_call_id", "needs the id"),
    ([USER, {"role": "assistant", "content": None}, USER], "messages[1].content", "needs content or tool_calls"),
    ([USER, {"role": "assistant"}], "messages[1].content", "needs content or tool_calls"),
    ([USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages[1].tool_call_id", "answers no call"),
    ([USER, CALLS, ANSWER_1, {**ANSWER_2, "tool_call_id": "call_9"}], "messages[3].tool_call_id", "not a call of"),
    ([USER, CALLS, ANSWER_1, ANSWER_1, ANSWER_2], "messages[3].tool_call_id", "already answered by messages[2]"),
    ([USER, CALLS, ANSWER_1], "messages[1].tool_calls", "'call_2' has none"),
    ([USER, CALLS, ANSWER_1, USER, ANSWER_2], "messages[1].tool_calls", "'call_2' has none"),
    ([USER, CALLS, ANSWER_1, ANSWER_2, USER, CALLS], "messages[5].tool_calls[0].id", "already the id of"),
    ([USER, {**CALLS, "tool_calls": []}], "messages[1].tool_calls", "an empty array"),
    ([{"role": "user", "content": None}], "messages[0].content", "a user message needs content"),
    ([{"role": "system"}, USER], "messages[0].content", "a system message needs content"),
    ([USER, CALLS, {**ANSWER_1, "content": None}, ANSWER_2], "messages[2].content", "a tool message needs content"),
    ([{"role": "user", "content": []}], "messages[0].content", "an empty array"),
    ([{"role": "system", "content": [IMAGE]}, USER], "messages[0].content[0]", "images and videos go in user"),
    ([USER, {"role": "user", "content": "x", "tool_calls": CALLS["tool_calls"]}], "messages[1].tool_calls", "only"),
]


def _messages(conversation):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": conversation}).messages


@pytest.mark.parametrize("conversation", VALID)
def test_valid_conversations_pass(conversation):
    check_conversation(_messages(conversation))


@pytest.mark.parametrize(("conversation", "param", "words"), INVALID)
def test_invalid_conversations_name_the_field(conversation, param, words):
    with pytest.raises(APIError) as refused:
        check_conversation(_messages(conversation))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.message.startswith(f"{param}: ") and words in refused.value.message


ABSENT = object()
ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENTS = (ABSENT, None, "", "x", [], [{"type": "text", "text": "x"}], [IMAGE])
OWN_CALLS = (ABSENT, None, [], [{"id": "call_own", "function": {"name": "f", "arguments": "{}"}}],
             [{"id": "", "function": {"name": "f", "arguments": "{}"}}])  # fmt: skip
CALL_IDS = (ABSENT, None, "", "call_1")
CALLER = {**CALLS, "tool_calls": CALLS["tool_calls"][:1]}


def _in_context(message: dict) -> list[dict]:
    """``message`` where the rules between messages hold whatever it is: a tool message right after a call it may
    answer, anything else after that call's answer, and an answer to each call of its own."""
    if message["role"] == "tool":
        return [USER, CALLER, message]
    answers = [{"role": "tool", "tool_call_id": "call_own", "content": "x"}] if message.get("tool_calls") else []
    return [USER, CALLER, ANSWER_1, message, *answers]


def _gateway_takes(conversation: list[dict]) -> bool:
    try:
        check_conversation(_messages(conversation))
    except APIError:
        return False
    return True


def test_the_published_message_schema_takes_what_the_gateway_takes():
    """The OpenAPI document's per-role messages (what a client generated from it writes) agree with the chat
    route's rules on every combination of content, tool calls and call id, for every role."""
    document = jsonschema.Draft202012Validator(ChatCompletionRequest.model_json_schema())
    disagreements = []
    for role, content, calls, call_id in itertools.product(ROLES, CONTENTS, OWN_CALLS, CALL_IDS):
        fields = {"content": content, "tool_calls": calls, "tool_call_id": call_id}
        message = {"role": role, **{key: value for key, value in fields.items() if value is not ABSENT}}
        conversation = _in_context(message)
        published = document.is_valid({"model": "m", "messages": conversation})
        if published != _gateway_takes(conversation):
            disagreements.append((message, "published" if published else "refused by the document"))
    assert not disagreements, disagreements[:5]
    assert document.is_valid({"model": "m", "messages": [USER, CALLS, ANSWER_1, ANSWER_2]})


def test_the_issue_cases_are_400s_through_the_openai_client(client, model_name):
    cases = [
        ([USER, CALLS, {"role": "tool", "content": "18 C"}, ANSWER_2], "messages[2].tool_call_id"),
        ([USER, {"role": "assistant", "content": None}, USER], "messages[1].content"),
        ([USER, CALLS, {**ANSWER_1, "tool_call_id": "call_7"}, ANSWER_2], "messages[2].tool_call_id"),
    ]
    for conversation, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model_name, messages=conversation, max_tokens=1)
        assert refused.value.body["param"] == param, refused.value.body


def test_a_valid_tool_conversation_is_served(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=[USER, CALLS, ANSWER_1, ANSWER_2], max_tokens=2
    )
    assert response.usage.completion_tokens >= 1


# (body change, param, message): what a client sees when a value fails a union or a nested model.
UNION_CASES = [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: expected a string or an array of objects with a known 'type', got an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url",
     "messages[0].content[0].image_url: Field required"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "messages[1].tool_calls[0].function.arguments: Field required"),
    ({"stop": 7}, "stop", "stop: expected a string or an array of strings, got an integer"),
    # A tagged object's type is not part of the path, nor a token id in logit_bias a union branch.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5}}}, "response_format.json_schema.name",
     "response_format.json_schema.name: Input should be a valid string"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema: Field required"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5",
     "logit_bias.5: Input should be a valid number, unable to parse string as a number"),
    ({"logit_bias": {"5": "x", "6": "y"}}, "logit_bias.5",
     "logit_bias.5: Input should be a valid number, unable to parse string as a number"),
    ({"tool_choice": "always"}, "tool_choice",
     "tool_choice: expected one of 'none', 'auto', 'required' or an object, got a string"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "param", "message"), UNION_CASES)
def test_union_failures_say_what_was_expected_in_plain_words(gateway, model_name, change, param, message):
    body = {"model": model_name, "messages": [USER], "max_tokens": 1, **change}
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (param, message)


def test_completion_prompt_unions_in_plain_words(gateway, model_name):
    expected = "prompt: expected a string, an array of strings, an array of integers or an array of arrays of integers"
    for prompt, param, message in [
        ({"text": "hi"}, "prompt", f"{expected}, got an object"),
        ([[1, 2], [3, -1]], "prompt[1][1]", "prompt[1][1]: Input should be greater than or equal to 0"),
        ([], "prompt", "prompt: List should have at least 1 item after validation, not 0"),
    ]:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1}
        error = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=60).json()["error"]
        assert (error["param"], error["message"]) == (param, message)


def test_a_chat_sent_to_tokenize_is_checked_as_a_chat(gateway, model_name):
    """/tokenize takes a text prompt or a chat: a chat's error is reported, not the prompt it has no need of."""
    image = {"type": "image_url", "image_url": {"url": 5}}
    body = {"model": model_name, "messages": [{"role": "user", "content": [image]}]}
    error = httpx.post(f"{gateway.base_url}/tokenize", json=body, timeout=60).json()["error"]
    assert (error["param"], error["message"]) == (
        "messages[0].content[0].image_url.url",
        "messages[0].content[0].image_url.url: Input should be a valid string",
    )
