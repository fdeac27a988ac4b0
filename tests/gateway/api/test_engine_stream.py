"""The gateway's two ways of calling an engine give the same answers: every request over the engine's shared
GenerateStream (the default), or a Generate call per request (``--engine-stream request``)."""

import pytest

pytestmark = pytest.mark.xdist_group("gateway_api")

MESSAGES = [{"role": "user", "content": "Name three rivers and one mountain."}]


@pytest.fixture(scope="module")
def per_request_client(stack, engine):
    return stack.gateway([engine], "--media-workers", "0", "--engine-stream", "request").client()


def test_shared_and_per_request_engine_streams_give_the_same_tokens(client, per_request_client, model_name):
    body = dict(model=model_name, messages=MESSAGES, temperature=0, max_tokens=20, n=2, extra_body={"ignore_eos": True})
    answers = []
    for api in (client, per_request_client):
        whole = api.chat.completions.create(**body)
        streamed = ["", ""]
        for chunk in api.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        assert [choice.message.content for choice in whole.choices] == streamed
        assert whole.usage.completion_tokens == 2 * 20
        answers.append(streamed)
    assert answers[0] == answers[1]
