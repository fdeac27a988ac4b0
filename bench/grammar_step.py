"""The decode step with every request under a JSON schema against the same step unconstrained (H200).

The engine of ``bench.engine_step`` (random weights, M3 attention dims, 16 layers, M3's 200,064-token vocabulary,
bf16, decode CUDA graphs, async scheduling) decodes ``n`` requests of ``--context`` prompt tokens, for n in 1, 16
and 64: ``--steps`` timed steps free (greedy), then the same with every request constrained by a JSON schema
(objects with strings, an enum, numbers, booleans and a nested array, one after another: ``start: item+``, so
no request completes during the measurement and every step masks every row).  A constrained step launches its
forward, applies the previous step's tokens to the matchers, builds the 64 masks on the host (llguidance's
threads) while the forward runs, uploads them and samples: the ratio says what is left of that cost.
Target: <= 1.10x the free step at 64 requests.  Medians of the engine's step period (one ``EngineCore.step``).

Grammars need a tokenizer of the model's vocabulary; M3's is not on that machine, so the stand-in of
``bench.grammar_masks`` (o200k_base padded with M3's special tokens to 200,064 ids, ``--vocab``) serves.

    python -m bench.grammar_step --vocab PATH/o200k_base.tiktoken.gz [--out DIR] [--steps 60]
"""

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llguidance
import torch

from bench.common import markdown_table, write_results
from bench.engine_step import VOCAB, build_model
from bench.grammar_masks import JSON_SCHEMA, M3_EOS_ID, PRETOKENIZE_PATTERN, load_vocabulary
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.core import assemble_engine_core
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.grammar import GrammarCompiler
from m3stack.engine.runtime.request import SamplingParams
from m3stack.engine.runtime.validation import build_request

logger = logging.getLogger("bench.grammar_step")

CONCURRENCIES = (1, 16, 64)
WARMUP_STEPS = 10
PREFILL_STEPS_MARGIN = 64
# Compact JSON (no free whitespace): random weights then walk through keys, values and nesting instead of spaces.
SCHEMA = {**JSON_SCHEMA, "x-guidance": {"whitespace_flexible": False}}
GRAMMAR = f"start: item+\nitem: %json{json.dumps(SCHEMA)}"


def measure(core: EngineCore, concurrency: int, context: int, steps: int, grammar: str | None) -> dict[str, Any]:
    rng = random.Random(concurrency)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_STEPS + steps + PREFILL_STEPS_MARGIN,
                              ignore_eos=True, grammar=grammar)  # fmt: skip
    label = "json" if grammar else "free"
    logger.info("point: %s x %d", label, concurrency)
    for index in range(concurrency):
        prompt = [rng.randrange(VOCAB - 200) for _ in range(context)]
        core.add_request(build_request(core.info, f"{label}{concurrency}-{index}", prompt, sampling))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    for _ in range(WARMUP_STEPS):
        core.step()
    runner = core.runner
    runner.timing = True
    graph_steps_before = runner.num_graph_steps
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        report = core.step()
        wall = time.perf_counter() - start
        if report.num_requests != concurrency or not report.is_pure_decode:
            raise RuntimeError(f"step ran {report.num_requests} requests, pure decode {report.is_pure_decode}")
        samples.append((wall, runner.last_timing.gpu_s, report.wait_s, report.update_s))
    runner.timing = False
    for request_id in list(core.scheduler.requests):
        core.abort_request(request_id, "benchmark done")
    while core.has_work:
        core.step()
    wall, gpu, wait, update = (statistics.median(column) for column in zip(*samples, strict=True))
    return {
        "concurrency": concurrency,
        "mode": label,
        "graphs": runner.num_graph_steps - graph_steps_before == steps,
        "wall_ms": wall * 1e3,
        "gpu_ms": gpu * 1e3,
        "wait_ms": wait * 1e3,
        "update_ms": update * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, required=True, help="o200k_base.tiktoken(.gz)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logger.error("bench.grammar_step needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    _, ranks, specials = load_vocabulary(args.vocab, VOCAB)
    tokenizer = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
        encoder=ranks, special_tokens=specials, pattern=PRETOKENIZE_PATTERN, eos_token=M3_EOS_ID, n_vocab=VOCAB
    )
    model, m3 = build_model(args.layers, False, device)
    max_len = args.context + WARMUP_STEPS + args.steps + PREFILL_STEPS_MARGIN + 16
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=max(CONCURRENCIES), max_num_batched_tokens=8192,
                          max_model_len=max_len, num_kv_blocks=2 * max(CONCURRENCIES) * -(-max_len // 128),
                          cuda_graphs=True, async_scheduling=True)  # fmt: skip
    core = assemble_engine_core(config, model, m3, model_path=f"random-m3-dims-{args.layers}-layers", device=device,
                                dtype=torch.bfloat16)  # fmt: skip
    core.grammars = GrammarCompiler(Path("unused"), VOCAB, [M3_EOS_ID], tokenizer=tokenizer)
    rows = []
    for concurrency in CONCURRENCIES:
        free = measure(core, concurrency, args.context, args.steps, None)
        constrained = measure(core, concurrency, args.context, args.steps, GRAMMAR)
        constrained["ratio_to_free"] = constrained["wall_ms"] / free["wall_ms"]
        rows += [free, constrained]
        logger.info("%s / %s", free, constrained)
    extra = {
        "model": f"random weights, M3 attention dims, {args.layers} layers, dense MLPs, bf16, vocab {VOCAB}",
        "vocabulary": "o200k_base padded with M3's special tokens (M3's tokenizer stand-in)",
        "grammar": GRAMMAR,
        "context": args.context,
        "steps": args.steps,
        "target": "json wall_ms <= 1.10x free at 64 requests",
    }
    write_results("grammar_step", rows, extra, out_dir=args.out)
    columns = ["concurrency", "mode", "graphs", "wall_ms", "gpu_ms", "wait_ms", "update_ms", "ratio_to_free"]
    sys.stdout.write(markdown_table(rows, columns) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
