"""Talking to running gateways and engines from tests: metrics scrapes, polling, a streamed request in a thread."""

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Gateway flags for test stacks.  Probes every 0.2 s find a new or restarted engine quickly.  Their deadline is
# generous: on two cores shared with the other test workers an idle engine process can go seconds unscheduled,
# and an engine that misses two probes is taken down with its requests.  A killed engine refuses at once.
TEST_HEALTH_ARGS = ("--health-interval", "0.2", "--health-timeout", "5")


def scrape(url: str) -> Samples:
    """A /metrics page -> {(sample name, sorted labels): value}."""
    return parse_samples(httpx.get(url, timeout=10).text)


def parse_samples(text: str) -> Samples:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def series(samples: Samples, name: str, **labels: str) -> float:
    """The value of ``name``'s sample with exactly ``labels``; KeyError when there is none."""
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none): a vLLM-named
    metric carries ``model_name`` and ``engine`` labels a test need not spell out."""
    wanted = set(labels.items())
    return sum(value for (sample, labelled), value in samples.items() if sample == name and wanted <= set(labelled))


def poll_until(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """``condition()``'s first truthy value; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class StreamRunner(threading.Thread):
    """One streamed completion (``ignore_eos``, so it runs to ``max_tokens``) in a thread: how it ended,
    how many chunks it received and when it ended (``time.monotonic()``)."""

    def __init__(self, client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self._client, self._model, self._prompt, self._max_tokens = client, model, prompt, max_tokens
        self.error: Exception | None = None
        self.finish_reason: str | None = None
        self.chunks = 0
        self.text = ""
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            stream = self._client.completions.create(
                model=self._model,
                prompt=self._prompt,
                max_tokens=self._max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.chunks += 1
                if chunk.choices:
                    self.text += chunk.choices[0].text
                    self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except openai.APIError as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
