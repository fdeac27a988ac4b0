"""A bounded load test of the local stack: 256 streamed chat requests at concurrency 32, a quarter of them
with an image, through the ``openai`` client.  Every request completes with every token exactly once: the
ids streamed in the chunks' logprobs, the streamed text, the usage count and the engines' own token counters
all agree.  Throughput and latency are logged, not asserted (``python -m bench.local_load`` records them)."""

import asyncio
import logging

import pytest

from bench.local_load import IMAGE_EVERY, result_rows, run_load
from tests.e2e.conftest import engine_metrics, gateway_metrics
from tests.helpers.serving import total

pytestmark = pytest.mark.xdist_group("e2e")

logger = logging.getLogger(__name__)

REQUESTS = 256
CONCURRENCY = 32
MAX_TOKENS = 12
GENERATED = "vllm:generation_tokens_total"


def engines_generated(stack) -> float:
    return sum(total(engine_metrics(stack, index), GENERATED) for index in range(len(stack.engines)))


def peak_inflight_total(stack) -> float:
    return sum(
        value
        for (name, _labels), value in gateway_metrics(stack).items()
        if name == "m3stack_gateway_engine_inflight_requests"
    )


def test_concurrency_32_every_request_completes_with_every_token_once(stack, hf_tokenizer, record_property):
    generated_before = engines_generated(stack)

    async def scenario():
        peak = 0.0

        async def watch(done: asyncio.Event) -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await asyncio.to_thread(peak_inflight_total, stack))
                await asyncio.sleep(0.2)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            return await run_load(stack.base_url, stack.served_model_name, REQUESTS, CONCURRENCY, MAX_TOKENS), peak
        finally:
            done.set()
            await watcher

    (records, elapsed), peak = asyncio.run(scenario())
    # Sampled every 0.2 s: 12-token requests spend much of their time in the gateway (tokenizing, the images'
    # preprocessing) and the HTTP layer, and on a loaded machine the peak seen at the engines can be well below 32.
    # A gateway that serialized requests would show 1-2.
    assert peak >= CONCURRENCY // 4, f"the requests did not overlap (peak in flight {peak})"
    assert [r.index for r in records] == list(range(REQUESTS))
    failed = [(r.index, r.kind, r.error) for r in records if r.error is not None]
    assert not failed
    for record in records:
        assert len(record.token_ids) == record.completion_tokens == MAX_TOKENS, record
        assert record.finish_reason == "length", record
        assert record.text == hf_tokenizer.decode(record.token_ids, skip_special_tokens=True), record
    assert sum(r.kind == "image" for r in records) == REQUESTS // IMAGE_EVERY
    # What the engines generated is what the clients received: no token generated twice or dropped on the way.
    assert engines_generated(stack) - generated_before == REQUESTS * MAX_TOKENS
    for row in result_rows(records, elapsed, CONCURRENCY):
        logger.info("local stack load: %s", row)
        record_property(f"load_{row['kind']}", row)
