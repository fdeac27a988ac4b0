"""engine.proto's sampling controls over loopback gRPC: grammars compile off the engine thread (a bad one is
INVALID_ARGUMENT on Generate and in-band on GenerateStream), logit_bias and penalties arrive intact, bad values are
refused by name, and prompt logprobs come once, in the first chunk."""

import json

import grpc
import pytest
from tokenizers import Tokenizer

from m3stack.proto import engine_pb2 as pb
from tests.engine.server.test_generate_stream import Inputs, by_request, start
from tests.engine.server.test_grpc_server import _prompt, collect, generate_request

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def _with_grammar(request_id: str, lark: str, **sampling) -> pb.GenerateRequest:
    request = generate_request(request_id, _prompt(21, 12), 64, ignore_eos=False, **sampling)
    request.sampling.grammar.lark = lark
    return request


def test_a_grammar_constrains_generate_and_ends_it_with_stop(server, tiny_model_dir):
    tokens, _, complete = collect(server.stub.Generate(_with_grammar("json", f"start: %json{json.dumps(SCHEMA)}")))
    assert complete is not None and complete.finish_reason == pb.FINISH_REASON_STOP
    assert not complete.HasField("matched_stop_token_id"), "the grammar ended it, not a stop token"
    document = json.loads(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(tokens))
    assert set(document) == {"ok", "n"}


def test_a_grammar_that_does_not_compile_is_invalid_argument_naming_the_error(server):
    with pytest.raises(grpc.RpcError) as caught:
        collect(server.stub.Generate(_with_grammar("bad", 'start: "{" missing_rule "}"')))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the grammar does not compile" in caught.value.details() and "missing_rule" in caught.value.details()


def test_on_one_stream_a_bad_grammar_is_refused_in_band_and_the_others_run(server):
    inputs = Inputs(
        start(_with_grammar("s-bad", "start: undefined")),
        start(_with_grammar("s-good", f"start: %json{json.dumps(SCHEMA)}")),
        start(generate_request("s-free", _prompt(22, 9), 6)),
    )
    inputs.close()
    responses, _ = by_request(server.stub.GenerateStream(iter(inputs), timeout=120))
    [refusal] = responses["s-bad"]
    assert refusal.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "does not compile" in refusal.error.message
    assert collect(responses["s-good"])[2].finish_reason == pb.FINISH_REASON_STOP
    assert len(collect(responses["s-free"])[0]) == 6
    server.wait_idle()
    assert server.engine.num_live_requests == 0


def test_logit_bias_and_penalties_arrive_intact(server):
    tokens, _, _ = collect(server.stub.Generate(generate_request("bias", _prompt(23, 10), 6, logit_bias={42: 100.0})))
    assert tokens == [42] * 6
    plain, _, _ = collect(server.stub.Generate(generate_request("plain", _prompt(24, 10), 12, logit_bias={42: 4.0})))
    penalized, _, _ = collect(
        server.stub.Generate(generate_request("pen", _prompt(24, 10), 12, logit_bias={42: 4.0}, frequency_penalty=2.0))
    )
    assert plain.count(42) > penalized.count(42)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be in (0, 2]"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias token ids [1000000] are outside the vocabulary"),
        ({"logit_bias": {3: -101.0}}, "logit_bias values must be in [-100, 100]"),
        ({"prompt_logprobs": 50}, "prompt_logprobs must be in [0, 20]"),
    ],
)
def test_out_of_range_controls_are_invalid_argument(server, sampling, message):
    with pytest.raises(grpc.RpcError) as caught:
        collect(server.stub.Generate(generate_request("range", _prompt(25, 5), 2, **sampling)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()


def test_prompt_logprobs_come_once_in_the_first_chunk(server):
    prompt = _prompt(26, 17)
    _, chunks, _ = collect(server.stub.Generate(generate_request("echo", prompt, 3, prompt_logprobs=2)))
    first = chunks[0].prompt_logprobs
    assert len(first.logprobs) == len(prompt) - 1 and len(first.top_logprobs) == len(prompt) - 1
    assert all(len(top.token_ids) == 2 and top.logprobs[0] >= top.logprobs[1] for top in first.top_logprobs)
    assert all(value <= 0 for value in first.logprobs)
    assert not any(chunk.HasField("prompt_logprobs") for chunk in chunks[1:])
