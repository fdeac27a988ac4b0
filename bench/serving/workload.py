"""The agentic workload: one shared prefix, a unique suffix per request, random prompt ids drawn the same in
every config and in every process."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Workload:
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    token_limit: int  # prompt ids are drawn from [0, token_limit): below the image/video placeholders
    seed: int = 0

    def prefix(self) -> list[int]:
        return random_ids(random.Random(f"{self.seed}-prefix"), self.prefix_tokens, self.token_limit)

    def prompt(self, prefix: list[int], key: str) -> list[int]:
        """The shared prefix plus a suffix unique to ``key`` (the same in every config)."""
        return prefix + random_ids(random.Random(f"{self.seed}-{key}"), self.suffix_tokens, self.token_limit)

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens


def random_ids(rng: random.Random, count: int, limit: int) -> list[int]:
    return [rng.randrange(limit) for _ in range(count)]


def requests_per_point(concurrency: int, minimum: int) -> int:
    return max(concurrency, minimum)
