"""A bounded load test: 64 concurrent streams, every token delivered exactly once and in order."""

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers.serving import parse_samples, total

pytestmark = pytest.mark.xdist_group("gateway_api")

STREAMS = 64
TOKENS = 24


async def one_stream(client: openai.AsyncOpenAI, model: str, index: int) -> tuple[list[int], str, int]:
    stream = await client.completions.create(
        model=model,
        prompt=f"Stream number {index} says:",
        max_tokens=TOKENS,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
        temperature=1.0,
        seed=index,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    ids, text, usage = [], "", 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                ids += [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
    return ids, text, usage


async def peak_inflight(gateway, engine, stop: asyncio.Event) -> float:
    peak = 0.0
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            samples = parse_samples((await http.get(f"{gateway.base_url}/metrics")).text)
            peak = max(peak, total(samples, "m3stack_gateway_engine_inflight_requests", engine=engine.address))
            await asyncio.sleep(0.05)
    return peak


def test_64_concurrent_streams_deliver_every_token_once(gateway, engine, model_name, hf_tokenizer):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        stop = asyncio.Event()
        watcher = asyncio.create_task(peak_inflight(gateway, engine, stop))
        start = time.monotonic()
        results = await asyncio.gather(*(one_stream(client, model_name, i) for i in range(STREAMS)))
        elapsed = time.monotonic() - start
        stop.set()
        await client.close()
        return results, elapsed, await watcher

    results, elapsed, peak = asyncio.run(scenario())
    assert elapsed < 240
    assert peak >= STREAMS // 2, f"the streams did not overlap (peak in-flight {peak})"
    for ids, text, usage in results:
        assert len(ids) == usage == TOKENS
        assert text == hf_tokenizer.decode(ids, skip_special_tokens=True)
