"""Drive a request's engine streams to the end: one ``ChoiceDelta`` stream for all its choices.

Whatever way iteration ends (done, a stop string, an engine failure, the client leaving), every
engine stream is closed exactly once, and those still running are aborted on the engine.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from m3stack.gateway.engine_client.events import Completion
from m3stack.gateway.generation.choice import ChoiceDecoder, ChoiceDelta
from m3stack.gateway.generation.dispatch import EngineStream, EngineStreamError
from m3stack.gateway.metrics import GatewayMetrics


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ChoiceRun:
    """One choice: its engine stream, its decoder, and which prompt it continues."""

    stream: EngineStream
    decoder: ChoiceDecoder
    prompt_index: int


class Generation:
    def __init__(self, runs: Sequence[ChoiceRun], metrics: GatewayMetrics, arrival_s: float) -> None:
        self._runs = list(runs)
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._first_token_seen = False
        # How interrupted streams are reported to the engine and in metrics; an exception changes it.
        self._interruption = "client_disconnected"

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        try:
            if len(self._runs) == 1:
                async for delta in self._run_one(self._runs[0]):
                    yield delta
            else:
                async for delta in self._run_merged():
                    yield delta
        except EngineStreamError:
            self._interruption = "engine_failed_elsewhere"
            raise
        except Exception:
            self._interruption = "error"
            raise
        finally:
            for run in self._runs:
                run.stream.close(self._interruption)

    async def _run_one(self, run: ChoiceRun) -> AsyncIterator[ChoiceDelta]:
        stream, decoder = run.stream, run.decoder
        last_token_s = 0.0
        event = stream.first
        try:
            while True:
                complete = isinstance(event, Completion)
                if complete and event.finish_reason == "abort":
                    message = event.abort_message or "no reason given"
                    raise EngineStreamError(f"engine {stream.engine.address} aborted the request: {message}")
                delta = decoder.on_event(event)
                if delta.num_tokens:
                    last_token_s = self._observe_tokens(delta.num_tokens, last_token_s)
                if complete:
                    stream.close("completed")
                elif decoder.finished:
                    stream.close("stop_string")
                yield delta
                if decoder.finished:  # always so after the complete response
                    return
                event = await stream.read()
        except EngineStreamError:
            stream.close("failed")
            raise

    async def _run_merged(self) -> AsyncIterator[ChoiceDelta]:
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

        async def pump(run: ChoiceRun) -> None:
            try:
                async for delta in self._run_one(run):
                    queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(run)) for run in self._runs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe_tokens(self, num_tokens: int, last_token_s: float) -> float:
        now = time.perf_counter()
        if not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.time_to_first_token.observe(now - self._arrival_s)
        if last_token_s:
            self._metrics.inter_token_latency.observe(now - last_token_s)
        self._metrics.generation_tokens.inc(num_tokens)
        return now

    def usage(self) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), completion tokens over all choices."""
        first_run_of_prompt: dict[int, ChoiceRun] = {}
        for run in self._runs:
            first_run_of_prompt.setdefault(run.prompt_index, run)
        return Usage(
            prompt_tokens=sum(run.decoder.prompt_tokens for run in first_run_of_prompt.values()),
            completion_tokens=sum(run.decoder.completion_tokens for run in self._runs),
            cached_tokens=sum(run.decoder.cached_tokens for run in first_run_of_prompt.values()),
        )
