"""Logprobs of the prompt tokens (``SamplingParams.prompt_logprobs``, the OpenAI completions ``echo`` with logprobs).

A prefill chunk ``[s, s + n)`` of a request computes the hidden states that predict tokens ``s + 1 .. s + n``; the
prompt's tokens among them (up to ``P - 1``) get the log-softmax of their logits at their own id, and the top-n.
Token 0 has no context and gets none.  Such a request never reads the prefix cache (a cached token has no
hidden state here); after a preemption its recomputed chunks skip the targets already done.

The logits of a 2,048-token chunk at M3's vocabulary would take 1.6 GB in float32, so they are computed
``ROWS_PER_PASS`` rows at a time.  Results go to the host through pinned memory behind an event, so collecting
them never waits for steps launched later.
"""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from m3stack.engine.runtime.request import Request
from m3stack.engine.runtime.scheduler import SchedulerOutput

ROWS_PER_PASS = 256


class LogitsHead(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PromptLogprobTargets:
    """One request's prompt tokens predicted by this step: the hidden rows and the token each row predicts."""

    request: Request
    rows: np.ndarray  # [m] int64 rows of the step's flat batch
    token_ids: np.ndarray  # [m] int64


def prompt_logprob_targets(out: SchedulerOutput, query_start_loc: np.ndarray) -> list[PromptLogprobTargets]:
    """The requests of ``out`` that want prompt logprobs and compute some prompt token's predecessor this step.

    Books them as launched (``Request.prompt_logprobs_launched``), so a recomputed chunk is not counted twice."""
    targets = []
    for index, scheduled in enumerate(out.requests):
        request = scheduled.request
        if request.prompt_logprobs is None:
            continue
        first = max(scheduled.start + 1, request.prompt_logprobs_launched + 1)
        last = min(scheduled.start + scheduled.num_new_tokens, request.num_prompt_tokens - 1)
        if first > last:
            continue
        predicted = np.arange(first, last + 1, dtype=np.int64)
        rows = predicted - 1 - scheduled.start + int(query_start_loc[index])
        token_ids = np.asarray(request.token_ids[first : last + 1], dtype=np.int64)
        targets.append(PromptLogprobTargets(request, rows, token_ids))
        request.prompt_logprobs_launched = last
    return targets


@dataclass
class LaunchedPromptLogprobs:
    """Device results of a step's prompt logprobs, on their way to pinned host memory."""

    targets: list[PromptLogprobTargets]
    logprobs: torch.Tensor  # [m] float32 on the host once ``copied`` has passed
    top_logprobs: torch.Tensor | None  # [m, k]
    top_ids: torch.Tensor | None  # [m, k]
    copied: torch.cuda.Event | None = field(default=None, repr=False)

    def collect(self) -> None:
        """Append each request's results to ``request.prompt_logprobs`` (waits for the copy only)."""
        if self.copied is not None:
            self.copied.synchronize()
        logprobs = self.logprobs.tolist()
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else []
        top_ids = self.top_ids.tolist() if self.top_ids is not None else []
        offset = 0
        for target in self.targets:
            count = len(target.rows)
            collected = target.request.prompt_logprobs
            assert collected is not None
            collected.logprobs += logprobs[offset : offset + count]
            wanted = target.request.sampling.prompt_logprobs or 0
            for row in range(offset, offset + count if wanted else offset):
                collected.top.append((top_ids[row][:wanted], top_values[row][:wanted]))
            offset += count


def launch_prompt_logprobs(
    head: LogitsHead, hidden: torch.Tensor, targets: list[PromptLogprobTargets]
) -> LaunchedPromptLogprobs:
    """Compute the targets' logprobs from the step's ``hidden`` states [T, H] and start their copy to the host."""
    device = hidden.device
    rows = torch.from_numpy(np.concatenate([t.rows for t in targets])).to(device)
    token_ids = torch.from_numpy(np.concatenate([t.token_ids for t in targets])).to(device)
    top = max(t.request.sampling.prompt_logprobs or 0 for t in targets)
    chosen, top_values, top_ids = [], [], []
    for begin in range(0, len(rows), ROWS_PER_PASS):
        part = slice(begin, begin + ROWS_PER_PASS)
        logprobs = head.compute_logits(hidden[rows[part]]).float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(-1, token_ids[part, None]).squeeze(-1))
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    results = [torch.cat(chosen), torch.cat(top_values) if top else None, torch.cat(top_ids) if top else None]
    if device.type != "cuda":
        return LaunchedPromptLogprobs(targets, *results)
    on_host = [r.to("cpu", non_blocking=True) if r is not None else None for r in results]
    copied = torch.cuda.Event()
    copied.record()
    return LaunchedPromptLogprobs(targets, on_host[0], on_host[1], on_host[2], copied)
