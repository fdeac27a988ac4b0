"""Meet the engine's kernels before the first user does: synthetic requests through the real step loop.

Triton and FlashInfer compile a kernel the first time a launch meets its specialization.  On a fresh H200 the
MSA kernel set at M3 dims took ~90 s (the serving benchmark's first request), and every request of the batch
waits through a compile.  Decode steps' kernels compile when the CUDA graphs are captured; the others only when
a step first needs them.  ``warm_up`` runs, before the engine reports itself loaded:

1. a prompt of a few blocks and a partial one, then a few decode steps;
2. while that one decodes, a prompt sharing its full blocks (a prefix-cache hit) plus a suffix: a mixed step;
3. where the context and the KV cache allow, a prompt of ``SPLIT_CONTEXT_BLOCKS`` blocks, then a short chunk
   over it: the prefill indexer splits the keys of a short chunk over a long context.

Afterwards the prefix cache forgets the warm-up's blocks and the engine's counters restart from zero, so users
and metrics meet a fresh engine.  Token ids are random text ids: specializations do not depend on values.
"""

import logging
import random
import time
from dataclasses import dataclass

from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.offline import generate
from m3stack.engine.runtime.request import Request, SamplingParams

logger = logging.getLogger(__name__)

# 128 blocks of context let a one-tile chunk split the indexer's keys (prefill_index.default_key_splits: at
# least 64 blocks per split); a few more keep the split count above 1 whatever the tile count.
SPLIT_CONTEXT_BLOCKS = 160
_DECODE_TOKENS = 4


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prompt_tokens: int
    seconds: float
    split_keys: bool  # the long-context part ran


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=max_tokens)
    return Request(request_id, prompt, sampling, max_tokens=max_tokens)


def warm_up(core: EngineCore, seed: int = 0) -> WarmupReport:
    """Run the warm-up requests to completion on ``core`` (idle, this thread), then reset its caches and counters."""
    if core.has_work:
        raise RuntimeError("warm_up needs an idle engine")
    started = time.perf_counter()
    info, kv = core.info, core.scheduler.kv
    block = info.block_size
    text_ids = min(info.vocab_size, info.image_token_id, info.video_token_id)
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(text_ids) for _ in range(count)]

    room = min(info.max_model_len, kv.capacity_tokens) - _DECODE_TOKENS - 1
    first = tokens(min(3 * block + block // 2, room))
    if len(first) < 2:
        raise ValueError(f"a context of {info.max_model_len} tokens leaves no room for a warm-up")
    shared = first[: len(first) // block * block]
    second = shared + tokens(min(block // 2 + 1, room - len(shared)))
    batch = [_request("warmup-0", first, _DECODE_TOKENS), _request("warmup-1", second, _DECODE_TOKENS)]
    generate(core, batch, stagger_steps=2)
    prompt_tokens = len(first) + len(second)
    long_context = SPLIT_CONTEXT_BLOCKS * block
    split_keys = long_context + block <= room // 2
    if split_keys:
        context = tokens(long_context)
        generate(core, [_request("warmup-2", context, 1)])
        generate(core, [_request("warmup-3", context + tokens(block // 4 + 1), _DECODE_TOKENS)])
        prompt_tokens += 2 * long_context + block // 4 + 1
    _forget(core)
    report = WarmupReport(len(batch) + (2 if split_keys else 0), prompt_tokens, time.perf_counter() - started,
                          split_keys)  # fmt: skip
    logger.info("warm-up: %d requests, %d prompt tokens in %.1f s (long-context split keys: %s)",
                report.requests, report.prompt_tokens, report.seconds, split_keys)  # fmt: skip
    return report


def _forget(core: EngineCore) -> None:
    """Drop what the warm-up left: its cached blocks, the prefix and preemption counters, the step count, MSA's
    and CPU KV offload's counters (their first timed scans and copies would bracket the kernels' compiles)."""
    core.scheduler.kv.reset_prefix_cache()
    core.scheduler.num_preemptions = 0
    core.num_steps = 0
    if core.msa is not None:
        core.msa.reset()
    if core.offload is not None:
        core.offload.reset_counters()
