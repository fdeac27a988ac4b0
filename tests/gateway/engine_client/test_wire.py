"""The engine client's wire module against the engine's own side of engine.proto: requests the gateway builds parse
on the engine into the sampling the client asked for, and what the engine sends reads back as what it said."""

import dataclasses
from collections.abc import Sequence

from m3stack.engine.runtime.request import FinishReason, PromptLogprobs, RequestOutput, SamplingParams
from m3stack.engine.server.convert import responses_from_outputs, sampling_from_proto
from m3stack.gateway.api import params
from m3stack.gateway.engine_client import wire
from m3stack.gateway.engine_client.events import Completion, TokenChunk, TopTokens
from m3stack.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from m3stack.proto import engine_pb2

MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB = 100


def on_the_engine(request: SamplingRequest, grammar: str | None = None) -> list[engine_pb2.GenerateRequest]:
    """The engine requests of ``request``, as the engine parses them off the wire."""
    settings = params.sampling_params(request, 50, params.output_options(request), VOCAB)
    if grammar is not None:
        settings = dataclasses.replace(settings, grammar=grammar)
    requests = params.engine_requests("chatcmpl-1", [5, 6, 7], (), settings, request, 0, {"x-request-id": "client-9"})
    return [engine_pb2.GenerateRequest.FromString(wire.generate_request(r).SerializeToString()) for r in requests]


def test_a_request_without_settings_gets_the_engines_defaults():
    (message,) = on_the_engine(ChatCompletionRequest(model="m", messages=MESSAGES))
    assert sampling_from_proto(message.sampling) == SamplingParams(max_new_tokens=50)
    assert [field.name for field, _ in message.sampling.ListFields()] == ["max_new_tokens"]
    assert list(message.input_ids) == [5, 6, 7] and message.request_id == "chatcmpl-1-0"
    assert dict(message.metadata) == {"x-request-id": "client-9"}


def test_zero_is_sent_where_it_differs_from_unset_and_neutral_values_are_not():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, temperature=0.0, presence_penalty=0.0,
                                    repetition_penalty=1.0, min_tokens=0, logprobs=True, top_logprobs=0)  # fmt: skip
    (message,) = on_the_engine(request)
    sent = {field.name for field, _ in message.sampling.ListFields()}
    assert sent == {"max_new_tokens", "temperature", "logprobs"}
    assert sampling_from_proto(message.sampling).greedy


def test_every_setting_of_a_chat_arrives_and_each_choice_gets_its_seed():
    request = ChatCompletionRequest(
        model="m", messages=MESSAGES, n=3, seed=2**64 - 2, temperature=0.5, top_p=0.75, top_k=5, min_p=0.125,
        min_tokens=2, ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25,
        logit_bias={"9": 2.0, "3": -1.5}, stop_token_ids=[4, 8], logprobs=True, top_logprobs=3, cache_salt="salt",
        priority=-2,
    )  # fmt: skip
    messages = on_the_engine(request, grammar="start: /a+/")
    expected = SamplingParams(
        temperature=0.5, top_p=0.75, top_k=5, min_p=0.125, max_new_tokens=50, min_new_tokens=2,
        stop_token_ids=frozenset({4, 8}), ignore_eos=True, logprobs=True, top_logprobs=3, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.25, logit_bias=((3, -1.5), (9, 2.0)), grammar="start: /a+/",
    )  # fmt: skip
    seeds = [2**64 - 2, 2**64 - 1, 0]  # seed + choice index, modulo 2**64
    for index, (message, seed) in enumerate(zip(messages, seeds, strict=True)):
        assert sampling_from_proto(message.sampling) == dataclasses.replace(expected, seed=seed)
        assert message.request_id == f"chatcmpl-1-{index}"
        assert (message.cache_salt, message.priority) == ("salt", -2)


def test_echoed_prompt_logprobs_ask_for_every_prompt_token():
    (message,) = on_the_engine(CompletionRequest(model="m", prompt="x", logprobs=0, echo=True))
    assert message.sampling.HasField("prompt_logprobs") and message.sampling.prompt_logprobs == 0
    assert sampling_from_proto(message.sampling).prompt_logprobs == 0


def read(outputs: list[RequestOutput]) -> list[TokenChunk | Completion]:
    """What the engine sends for ``outputs``, through the wire and back."""
    sent = responses_from_outputs("r", outputs)
    return [wire.read_response(engine_pb2.GenerateResponse.FromString(r.SerializeToString())) for r in sent]


def pairs(tops: Sequence[TopTokens]) -> list[tuple[list[int], list[float]]]:
    assert all(isinstance(top, TopTokens) for top in tops)
    return [(list(top.token_ids), list(top.logprobs)) for top in tops]


def test_chunks_read_back_with_their_logprobs():
    first = RequestOutput(
        "r", new_token_ids=[11, 12], new_logprobs=[-0.5, -1.0], new_top_logprobs=[([11, 2], [-0.5, -2.0])] * 2,
        num_prompt_tokens=3, num_output_tokens=2, num_cached_tokens=2,
        prompt_logprobs=PromptLogprobs(logprobs=[-3.0, -4.0], top=[([1], [-0.25]), ([2], [-0.75])]),
    )  # fmt: skip
    (chunk,) = read([first])
    assert isinstance(chunk, TokenChunk)
    assert (list(chunk.token_ids), list(chunk.logprobs), chunk.cached_tokens) == ([11, 12], [-0.5, -1.0], 2)
    assert [(list(t.token_ids), list(t.logprobs)) for t in chunk.top_logprobs] == [([11, 2], [-0.5, -2.0])] * 2
    assert chunk.prompt_logprobs is not None and list(chunk.prompt_logprobs.logprobs) == [-3.0, -4.0]
    assert [(list(t.token_ids), list(t.logprobs)) for t in chunk.prompt_logprobs.top] == [
        ([1], [-0.25]),
        ([2], [-0.75]),
    ]
    (plain,) = read([RequestOutput("r", new_token_ids=[7], num_output_tokens=1)])
    assert isinstance(plain, TokenChunk) and (plain.top_logprobs, plain.prompt_logprobs) == ((), None)


def test_each_finish_reads_back_as_the_engine_ended():
    stopped = RequestOutput("r", [9], num_output_tokens=4, num_cached_tokens=1, finish_reason=FinishReason.STOP,
                            stop_token_id=9)  # fmt: skip
    assert read([stopped])[-1] == Completion("stop", completion_tokens=4, cached_tokens=1, matched_stop_token_id=9)
    length = RequestOutput("r", num_output_tokens=5, finish_reason=FinishReason.LENGTH)
    assert read([length]) == [Completion("length", completion_tokens=5, cached_tokens=0)]
    aborted = RequestOutput("r", finish_reason=FinishReason.ABORT, abort_message="drain deadline")
    assert read([aborted]) == [Completion("abort", 0, 0, abort_message="drain deadline")]
    # A completion without a reason ends like a stop.
    unspecified = engine_pb2.GenerateResponse(request_id="r", complete=engine_pb2.GenerateComplete(completion_tokens=2))
    assert wire.read_response(unspecified) == Completion("stop", completion_tokens=2, cached_tokens=0)
