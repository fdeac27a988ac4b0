"""Run requests through an ``EngineCore`` to completion in this thread, without a server (tests, benchmarks)."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.request import FinishReason, PromptLogprobs, Request


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)  # with SamplingParams.logprobs
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # (ids, logprobs) a token
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
    abort_message: str = ""


def generate(
    core: EngineCore, requests: Sequence[Request], *, stagger_steps: int = 0, check_invariants: bool = False
) -> dict[str, Generation]:
    """Every request's tokens, in order.  With ``stagger_steps`` > 0, request i joins i * stagger_steps steps late.

    A request that fails raises its ``EngineError``; ``check_invariants`` checks the scheduler and
    the block pool after every step.
    """
    results = {request.request_id: Generation() for request in requests}
    pending = list(requests)
    step = 0
    while pending or core.has_work:
        while pending and step >= stagger_steps * (len(requests) - len(pending)):
            core.add_request(pending.pop(0))
        report = core.step()
        for output in report.outputs:
            if output.error is not None:
                raise output.error
            result = results[output.request_id]
            result.token_ids += output.new_token_ids
            result.logprobs += output.new_logprobs
            result.top_logprobs += output.new_top_logprobs
            if output.prompt_logprobs is not None:
                result.prompt_logprobs = output.prompt_logprobs
            if output.finished:
                result.abort_message = output.abort_message
                result.finish_reason = output.finish_reason
                result.num_cached_tokens = output.num_cached_tokens
        if check_invariants:
            core.scheduler.check_invariants()
        step += 1
    return results
