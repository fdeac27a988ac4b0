"""Local stack under load: a few hundred streamed chat requests, text and images mixed, at a fixed
concurrency through the official ``openai`` client against ``m3stack up``'s processes (engines and
gateway on loopback, the tiny default model on CPU).  Run:

    python -m bench.local_load [--requests 256] [--concurrency 32] [--engines 2] [--out DIR]

Writes ``bench/results/local_load.json``: throughput (requests/s, output tokens/s) and latency p50/p99
(time to first token and end to end), overall and per kind.  ``tests/e2e/test_load.py`` runs the same
load and checks every token of every request instead of timing it.
"""

import argparse
import asyncio
import base64
import io
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
from PIL import Image

from bench.common import write_results

logger = logging.getLogger("bench.local_load")

LOOPBACK = "127.0.0.1"
IMAGE_EVERY = 4  # every fourth request carries an image
PROMPTS = (
    "Summarise how a paged KV cache works.",
    "Why does block-sparse attention scale to long contexts?",
    "List three things a gateway does before routing a request.",
    "Explain continuous batching to a new engineer.",
)
# The local stack's engines for a load run: a context that fits every prompt, room for the concurrency.
ENGINE_ARGS = ("--max-model-len", "1024", "--kv-cache-gb", "0.2", "--max-num-seqs", "32", "--cpu-threads", "1")


@dataclass
class RequestRecord:
    index: int
    kind: str  # "text" or "image"
    token_ids: list[int]  # as streamed, from the logprobs of each chunk
    text: str  # the streamed text, concatenated: reasoning_content (thinking is on by default), then content
    completion_tokens: int  # what the final usage chunk says
    finish_reason: str | None
    ttft_s: float
    latency_s: float
    error: str | None = None


def random_image_data_url(seed: int, size: int = 64) -> str:
    """A fresh noise PNG per request: no two requests share an image (no encoder or prefix cache hits)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def request_content(index: int, seed: int) -> tuple[str, list[dict[str, Any]]]:
    text = {"type": "text", "text": f"Request {index}: {PROMPTS[index % len(PROMPTS)]}"}
    if index % IMAGE_EVERY == IMAGE_EVERY - 1:
        image = {"type": "image_url", "image_url": {"url": random_image_data_url(seed * 100_003 + index)}}
        return "image", [image, text]
    return "text", [text]


async def one_request(client: openai.AsyncOpenAI, model: str, index: int, max_tokens: int, seed: int) -> RequestRecord:
    kind, content = request_content(index, seed)
    start = time.perf_counter()
    first: float | None = None
    ids: list[int] = []
    text, usage, finish = "", 0, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed * 100_003 + index,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                # The openai client keeps fields outside OpenAI's schema, like reasoning_content, as extras.
                reasoning = (choice.delta.model_extra or {}).get("reasoning_content") or ""
                if first is None and (choice.delta.content or reasoning or choice.logprobs):
                    first = time.perf_counter()
                text += reasoning + (choice.delta.content or "")
                if choice.logprobs and choice.logprobs.content:
                    ids += [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]
                finish = choice.finish_reason or finish
    except openai.APIError as exc:
        end = time.perf_counter()
        return RequestRecord(index, kind, ids, text, usage, finish, (first or end) - start, end - start, repr(exc))
    end = time.perf_counter()
    return RequestRecord(index, kind, ids, text, usage, finish, (first or end) - start, end - start)


async def run_load(
    base_url: str, model: str, requests: int, concurrency: int, max_tokens: int, seed: int = 0
) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` workers send the ``requests`` one after another; (records, seconds)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    indices = iter(range(requests))
    records: list[RequestRecord] = []

    async def worker() -> None:
        for index in indices:  # the iterator is shared: each index is taken once
            records.append(await one_request(client, model, index, max_tokens, seed))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return sorted(records, key=lambda r: r.index), time.perf_counter() - start


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def summarize(label: str, records: list[RequestRecord], elapsed_s: float, concurrency: int) -> dict[str, Any]:
    done = [r for r in records if r.error is None]
    latency_ms = [r.latency_s * 1e3 for r in done] or [float("nan")]
    ttft_ms = [r.ttft_s * 1e3 for r in done] or [float("nan")]
    return {
        "kind": label,
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(done),
        "output_tokens": sum(len(r.token_ids) for r in done),
        "requests_per_s": len(done) / elapsed_s,
        "output_tokens_per_s": sum(len(r.token_ids) for r in done) / elapsed_s,
        "ttft_p50_ms": statistics.median(ttft_ms),
        "ttft_p99_ms": p99(ttft_ms),
        "latency_p50_ms": statistics.median(latency_ms),
        "latency_p99_ms": p99(latency_ms),
    }


def result_rows(records: list[RequestRecord], elapsed_s: float, concurrency: int) -> list[dict[str, Any]]:
    """The whole run, then text and image requests alone (their throughput over the same wall time)."""
    rows = [summarize("all", records, elapsed_s, concurrency)]
    for kind in ("text", "image"):
        rows.append(summarize(kind, [r for r in records if r.kind == kind], elapsed_s, concurrency))
    return rows


def main() -> None:
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint
    from m3stack.local.processes import free_port
    from m3stack.local.stack import LocalStack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--media-workers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="local-load-") as logs:
        stack = LocalStack(
            ensure_tiny_checkpoint(),
            LOOPBACK,
            free_port(LOOPBACK),
            args.engines,
            "cpu",
            Path(logs),
            engine_args=ENGINE_ARGS,
            gateway_args=("--media-workers", str(args.media_workers)),
        )
        try:
            stack.start(engine_timeout_s=600, gateway_timeout_s=300)
            # One request first: the timed run should not include the engines' first-step warm-up.
            asyncio.run(run_load(stack.base_url, stack.served_model_name, IMAGE_EVERY, 1, args.max_tokens, seed=1))
            records, elapsed = asyncio.run(
                run_load(stack.base_url, stack.served_model_name, args.requests, args.concurrency, args.max_tokens)
            )
        finally:
            stack.stop()
    rows = result_rows(records, elapsed, args.concurrency)
    for row in rows:
        logger.info("%s", row)
    failed = [r for r in records if r.error is not None]
    extra = {
        "engines": args.engines,
        "max_tokens": args.max_tokens,
        "wall_s": elapsed,
        "failed": len(failed),
        "load_average_after": os.getloadavg()[0],  # this machine's cores are shared: context for the figures
    }
    write_results("local_load", rows, extra, args.out)


if __name__ == "__main__":
    main()
