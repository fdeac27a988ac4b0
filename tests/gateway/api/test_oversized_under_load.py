"""Oversized requests sent while other streams run leave those streams' inter-token latency as it was.

Each oversized request is refused from cheap bounds (the body cap, 413; the prompt's length against the
context, 400) instead of being tokenized: a body just under the cap costs the gateway ~25 ms of CPU to read and
parse (bench/oversized_requests.py), where tokenizing its 8 MB of text took seconds of a core.

Streams run throughout while pairs of oversized requests (one refused by the length bound, one by the body
cap) arrive between quiet spells.  Each gap between two tokens of a stream counts as quiet when no oversized
request was in the gateway at any point of it; interleaving keeps a neighbour's load on this shared machine
from passing for ours.  Two checks, each with a wide margin:

* the median gap over the whole run stays within 1.5x of the median quiet gap.  Gaps that overlap a refusal
  are stretched by its parse (and by the client sending 8 MB on the same two cores), but they are a minority,
  so the median moves by 10-20% (measured: 1.16x, 1.22x); tokenizing kept both cores busy for seconds and
  stretched most gaps (measured on the previous code: 1.4x, 2.3x);
* at least 4 pairs are answered while the streams run (measured: 15-17 pairs in one round of streams; the
  previous code answered one pair, each request taking seconds).  On a machine busy with other work the pairs
  come slower (one CI run saw 2 in a round), so the streams run again, up to ``MAX_ROUNDS`` rounds in all,
  until 4 pairs are answered: the previous code's rate stays below that.
"""

import asyncio
import itertools
import json
import logging
import statistics
import threading
import time

import httpx
import openai
import pytest

from m3stack.gateway.api.request_limits import DEFAULT_MAX_REQUEST_BYTES

pytestmark = pytest.mark.xdist_group("gateway_api")
logger = logging.getLogger(__name__)

STREAMS = 4
TOKENS = 200  # the engines here have a 256-token context
QUIET_S = 0.4
MARGIN = 1.5
MIN_PAIRS = 4
MAX_ROUNDS = 3


async def _arrivals(client: openai.AsyncOpenAI, model: str, index: int) -> list[float]:
    stream = await client.completions.create(
        model=model, prompt=f"Story {index}:", max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True}
    )
    arrivals = []
    async for chunk in stream:
        if chunk.choices:  # one chunk per engine step (its text may be empty: part of a UTF-8 character)
            arrivals.append(time.perf_counter())
    return arrivals[1:]  # from the second token: the first includes the prefill


def _streams(base_url: str, model: str) -> list[list[float]]:
    async def run() -> list[list[float]]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(_arrivals(client, model, i) for i in range(STREAMS)))

    return asyncio.run(run())


class OversizedSender:
    """Pairs of oversized requests (one over the context, one over the body cap) between quiet spells, until
    stopped; records when each was in the gateway and the statuses."""

    def __init__(self, base_url: str, model: str) -> None:
        text = "x" * (DEFAULT_MAX_REQUEST_BYTES - 4096)  # under the body cap, far over the 256-token context
        self._bodies = [
            ("/v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": text}]})),
            ("/v1/completions", json.dumps({"model": model, "prompt": "y" * DEFAULT_MAX_REQUEST_BYTES})),
        ]
        self._base_url = base_url
        self.intervals: list[tuple[float, float]] = []
        self.statuses: list[int] = []
        self.stop = threading.Event()

    def _send(self, http: httpx.Client, path: str, body: str) -> None:
        begin = time.perf_counter()
        response = http.post(f"{self._base_url}{path}", content=body, headers={"Content-Type": "application/json"})
        self.intervals.append((begin, time.perf_counter()))
        self.statuses.append(response.status_code)

    def run(self) -> None:
        with httpx.Client(timeout=300) as http:
            while not self.stop.wait(QUIET_S):
                pair = [threading.Thread(target=self._send, args=(http, *request)) for request in self._bodies]
                for thread in pair:
                    thread.start()
                for thread in pair:
                    thread.join()


def test_oversized_requests_leave_other_streams_inter_token_latency_unchanged(gateway, model_name):
    _streams(gateway.base_url, model_name)  # warm-up: first steps and connections
    sender = OversizedSender(gateway.base_url, model_name)
    thread = threading.Thread(target=sender.run)
    thread.start()
    try:
        streams = []
        for _ in range(MAX_ROUNDS):
            streams += _streams(gateway.base_url, model_name)
            if len(sender.statuses) >= 2 * MIN_PAIRS:
                break
    finally:
        sender.stop.set()
        thread.join(300)
    during, quiet = [], []
    for arrivals in streams:
        for earlier, later in itertools.pairwise(arrivals):
            overlaps = any(begin < later and end > earlier for begin, end in sender.intervals)
            (during if overlaps else quiet).append(later - earlier)
    everything = during + quiet
    logger.info(
        "RESULT %d oversized; quiet median %.1f ms (%d gaps); all median %.1f; during median %.1f p90 %.1f (%d gaps)",
        len(sender.statuses), 1e3 * statistics.median(quiet), len(quiet), 1e3 * statistics.median(everything),
        1e3 * statistics.median(during), 1e3 * statistics.quantiles(during, n=10)[-1], len(during),
    )  # fmt: skip
    assert set(sender.statuses) == {400, 413} and len(sender.statuses) >= 2 * MIN_PAIRS
    assert len(during) >= 10 and len(quiet) >= 10
    assert statistics.median(everything) <= MARGIN * statistics.median(quiet)
