"""GenerateStream over loopback gRPC: many requests on one stream give what their own Generate streams give,
batched; refusals and failures arrive in-band with Generate's status codes; aborts and a closed stream free
everything."""

import queue
from collections import defaultdict

import grpc

from m3stack.proto import engine_pb2 as pb
from tests.engine.server.test_grpc_server import _prompt, collect, generate_request

_END = object()


class Inputs:
    """The client's side of the stream: messages sent when the test says so."""

    def __init__(self, *messages: pb.GenerateStreamRequest) -> None:
        self._queue: queue.Queue = queue.Queue()
        for message in messages:
            self.send(message)

    def send(self, message: pb.GenerateStreamRequest) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(_END)

    def __iter__(self):
        while (message := self._queue.get()) is not _END:
            yield message


def start(request: pb.GenerateRequest) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(start=request)


def by_request(messages) -> tuple[dict[str, list[pb.GenerateResponse]], int]:
    """Each request's responses in arrival order, and how many stream messages carried them."""
    responses: dict[str, list[pb.GenerateResponse]] = defaultdict(list)
    count = 0
    for message in messages:
        count += 1
        assert message.responses, "an empty message"
        for response in message.responses:
            responses[response.request_id].append(response)
    return responses, count


def test_requests_on_one_stream_get_what_their_own_streams_get_in_fewer_messages(server):
    prompts = {f"m{i}": _prompt(100 + i, 8 + 5 * i) for i in range(12)}
    inputs = Inputs(*(start(generate_request(request_id, prompt, 10)) for request_id, prompt in prompts.items()))
    inputs.close()  # half-close: the stream still delivers every request to its end
    responses, messages = by_request(server.stub.GenerateStream(iter(inputs), timeout=120))
    assert set(responses) == set(prompts)
    for request_id, prompt in prompts.items():
        tokens, chunks, complete = collect(responses[request_id])
        assert complete is not None and complete.finish_reason == pb.FINISH_REASON_LENGTH, request_id
        assert len(tokens) == 10 and complete.prompt_tokens == len(prompt)
        assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
        if request_id in ("m0", "m7", "m11"):
            alone, _, _ = collect(server.stub.Generate(generate_request(f"{request_id}-own", prompt, 10)))
            assert alone == tokens, request_id
    # 12 requests x (>= 1 chunk + a completion) responses, and messages carrying several requests' at once.
    assert sum(len(r) for r in responses.values()) >= 24 and messages < sum(len(r) for r in responses.values())
    server.wait_idle()
    assert server.engine.num_live_requests == 0


def test_refused_requests_get_their_status_in_band_and_the_others_complete(server):
    vocab = server.core.info.vocab_size
    inputs = Inputs(
        start(generate_request("ok", _prompt(1, 12), 30)),
        start(generate_request("bad-token", [1, vocab + 5], 4)),
        start(generate_request("ok", _prompt(2, 12), 4)),  # the first "ok" still runs
        start(generate_request("bad-sampling", [1, 2], 4, temperature=-1.0)),
    )
    inputs.close()
    responses, _ = by_request(server.stub.GenerateStream(iter(inputs), timeout=60))
    errors = {rid: e.error for rid, r in responses.items() for e in r if e.HasField("error")}
    assert errors["bad-token"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"outside the vocabulary [0, {vocab})" in errors["bad-token"].message
    assert errors["bad-sampling"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert set(errors) == {"bad-token", "bad-sampling", "ok"}
    assert errors["ok"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]  # the duplicate, refused in-band
    # The first "ok" ran to its end despite the refusals on its stream.
    tokens, _, complete = collect(r for r in responses["ok"] if not r.HasField("error"))
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 30
    server.wait_idle()


def test_an_abort_on_the_stream_and_closing_the_stream_free_every_block(server):
    inputs = Inputs(
        start(generate_request("stopped", _prompt(3, 30), 400)),
        start(generate_request("left-running", _prompt(4, 30), 400)),
    )
    stream = server.stub.GenerateStream(iter(inputs), timeout=60)
    seen: dict[str, list[pb.GenerateResponse]] = defaultdict(list)
    for message in stream:
        for response in message.responses:
            seen[response.request_id].append(response)
        if "stopped" in seen and "left-running" in seen:
            break
    inputs.send(pb.GenerateStreamRequest(abort=pb.AbortRequest(request_id="stopped", reason="user pressed stop")))
    for message in stream:
        for response in message.responses:
            seen[response.request_id].append(response)
        if seen["stopped"][-1].HasField("complete"):
            break
    tokens, _, complete = collect(seen["stopped"])
    assert complete.finish_reason == pb.FINISH_REASON_ABORT and complete.abort_message == "user pressed stop"
    assert 0 < len(tokens) == complete.completion_tokens < 400
    stream.cancel()  # the client goes away with "left-running" mid-generation
    inputs.close()
    server.wait_idle()
    assert server.engine.num_live_requests == 0
    assert server.on_engine(lambda core: core.scheduler.kv.num_free_blocks) == 512
    assert not server.stub.Abort(pb.AbortRequest(request_id="left-running")).found
