"""bench.gateway_overhead's stub engine: its shared GenerateStream answers as its per-request Generate does, with a
step's responses of every request in one message (as the gateway's default shared stream expects of an engine)."""

import asyncio

import grpc

from bench.gateway_overhead import LOOPBACK, StepClock, StubEngine
from m3stack.proto import engine_pb2, engine_pb2_grpc

TOKENS = [11, 12, 13]


def _request(request_id: str, tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id, input_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams(max_new_tokens=tokens)
    )


async def _with_stub(scenario):
    clock = StepClock(0.002)
    steps = asyncio.create_task(clock.run())
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(StubEngine(TOKENS, clock, vocab_size=100), server)
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            return await scenario(engine_pb2_grpc.EngineStub(channel))
    finally:
        await server.stop(0)
        steps.cancel()


def test_shared_stream_gives_each_request_what_generate_gives_it_batched_per_step():
    async def scenario(stub):
        alone = {rid: [r async for r in stub.Generate(_request(rid, 5))] for rid in ("a", "b")}
        outbox: asyncio.Queue = asyncio.Queue()
        for rid in ("a", "b"):
            outbox.put_nowait(engine_pb2.GenerateStreamRequest(start=_request(rid, 5)))

        async def inputs():
            while (message := await outbox.get()) is not None:
                yield message

        shared: dict[str, list] = {"a": [], "b": []}
        sizes = []
        async for message in stub.GenerateStream(inputs()):
            sizes.append(len(message.responses))
            for response in message.responses:
                shared[response.request_id].append(response)
            if all(r and r[-1].HasField("complete") for r in shared.values()):
                outbox.put_nowait(None)  # half-close: the stub ends the call once nothing runs
        return alone, shared, sizes

    alone, shared, sizes = asyncio.run(_with_stub(scenario))
    assert shared == alone
    assert [r.chunk.token_ids[0] for r in alone["a"][:-1]] == [11, 12, 13, 11, 12]
    # A step's tokens of both requests travel together: fewer messages than the 12 responses.
    assert max(sizes) >= 2 and sum(sizes) == 12 and len(sizes) < 12


def test_an_abort_on_the_shared_stream_ends_that_request_only():
    async def scenario(stub):
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(engine_pb2.GenerateStreamRequest(start=_request("long", 10_000)))
        outbox.put_nowait(engine_pb2.GenerateStreamRequest(start=_request("short", 3)))

        async def inputs():
            while (message := await outbox.get()) is not None:
                yield message

        seen: dict[str, list] = {"long": [], "short": []}
        aborted = False
        async for message in stub.GenerateStream(inputs()):
            for response in message.responses:
                seen[response.request_id].append(response)
            if not aborted and seen["short"] and seen["short"][-1].HasField("complete"):
                outbox.put_nowait(engine_pb2.GenerateStreamRequest(abort=engine_pb2.AbortRequest(request_id="long")))
                outbox.put_nowait(None)
                aborted = True
        return seen

    seen = asyncio.run(asyncio.wait_for(_with_stub(scenario), timeout=30))
    assert seen["short"][-1].complete.completion_tokens == 3
    # The call ended (the loop above returned) long before the aborted request's 10,000 tokens.
    assert 3 <= len(seen["long"]) < 10_000 and not seen["long"][-1].HasField("complete")
