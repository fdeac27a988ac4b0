"""Penalties, logit bias and grammar masks on the GPU: captured in a CUDA graph over static buffers, and through
the engine with decode CUDA graphs and async scheduling (tiny checkpoint, float32)."""

import json
import random

import pytest
import torch
from tokenizers import Tokenizer

from m3stack.engine.assembly.build import build_engine_core
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.model.tiny import ensure_tiny_checkpoint
from m3stack.engine.runtime import offline
from m3stack.engine.runtime.grammar import apply_bitmask, bitmask_words
from m3stack.engine.runtime.penalties import apply_logit_bias, apply_penalties
from m3stack.engine.runtime.request import FinishReason, SamplingParams
from m3stack.engine.runtime.validation import build_request

pytestmark = pytest.mark.usefixtures("exact_float32")

M3_VOCAB = 200064
ROWS = 16
BIASES = 32
# A finite language: every document it allows is a few dozen bytes (``{"name":"carol","n":3}`` at most), so a
# greedy constrained row must complete it, and finish with STOP, well within its max_new_tokens.  An open one (a
# free integer, a string) let the random tiny model write valid JSON until LENGTH (the H200 run of 2026-12-04).
SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob", "carol"]}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
JSON_GRAMMAR = f"start: %json{json.dumps(SCHEMA)}"
CONSTRAINED_TOKENS = 120


def _controls(logits, counts, in_prompt, presence, frequency, repetition, rows, ids, bias, bitmask) -> torch.Tensor:
    out = apply_penalties(logits, counts, in_prompt, presence, frequency, repetition)
    apply_logit_bias(out, rows, ids, bias)
    apply_bitmask(out, bitmask)
    return out


def _fresh_inputs(seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    words = bitmask_words(M3_VOCAB)
    tensors = [
        torch.randn(ROWS, M3_VOCAB, generator=g) * 4,
        torch.randint(0, 3, (ROWS, M3_VOCAB), generator=g, dtype=torch.int32),
        torch.rand(ROWS, M3_VOCAB, generator=g) < 0.01,
        torch.rand(ROWS, generator=g) * 4 - 2,
        torch.rand(ROWS, generator=g) * 4 - 2,
        torch.rand(ROWS, generator=g) * 1.9 + 0.1,
        torch.randint(0, ROWS, (BIASES,), generator=g),
        torch.randint(0, M3_VOCAB, (BIASES,), generator=g),
        torch.rand(BIASES, generator=g) * 200 - 100,
        torch.randint(-(2**31), 2**31 - 1, (ROWS, words), generator=g, dtype=torch.int32),
    ]
    tensors[-1][0] = -1  # a free row: every token allowed
    return [t.to(device) for t in tensors]


def test_controls_replay_in_a_cuda_graph_as_they_run_eagerly_and_on_the_cpu():
    """The masks and penalties read only fixed-address buffers: captured once, replayed over fresh contents, they
    give the eager GPU result and the CPU one (M3's vocabulary, 16 rows)."""
    static = _fresh_inputs(0, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        _controls(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _controls(*static)
        captured_tokens = captured.argmax(dim=-1)
    for seed in (1, 2):
        fresh = _fresh_inputs(seed, "cuda")
        for buffer, value in zip(static, fresh, strict=True):
            buffer.copy_(value)
        graph.replay()
        eager = _controls(*fresh)
        on_cpu = _controls(*(t.cpu() for t in fresh))
        assert torch.equal(captured, eager)
        torch.testing.assert_close(captured.cpu(), on_cpu)
        assert torch.equal(captured_tokens, eager.argmax(dim=-1))
        assert bool(torch.isneginf(captured[1:]).any()) and not bool(torch.isneginf(captured[0]).any())


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(380) for _ in range(length)]


def _satisfies_schema(text: str) -> bool:
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return False
    # Checked by hand (the H200 has no jsonschema): exactly the two keys, each one of its enum's values.
    properties = SCHEMA["properties"]
    return (
        isinstance(document, dict)
        and set(document) == set(properties)
        and all(
            document[key] in spec["enum"] and type(document[key]) is type(spec["enum"][0])
            for key, spec in properties.items()
        )
    )


def _run(sampling: dict[str, SamplingParams], prompts: dict[str, list[int]], **overrides):
    settings = {"model": str(ensure_tiny_checkpoint()), "device": "cuda", "dtype": "float32", "num_kv_blocks": 512,
                "max_num_batched_tokens": 512, "max_num_seqs": 16, "cuda_graphs": True, "async_scheduling": True,
                **overrides}  # fmt: skip
    core = build_engine_core(EngineConfig(**settings))
    requests = [build_request(core.info, rid, prompts[rid], params) for rid, params in sampling.items()]
    results = offline.generate(core, requests, check_invariants=True)
    return results, core.runner


def test_a_mixed_batch_under_cuda_graphs_keeps_free_rows_exact_and_constrained_rows_valid():
    prompts = {f"r{i}": _prompt(i, 20 + 9 * i) for i in range(6)}
    free = {rid: SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True) for rid in ("r0", "r2", "r5")}
    # r1 unconstrained too: what it writes without the grammar's mask, which must not already satisfy the schema.
    unconstrained = SamplingParams(temperature=0.0, max_new_tokens=CONSTRAINED_TOKENS)
    alone, _ = _run({**free, "r1": unconstrained}, prompts)
    mixed_sampling = {
        **free,
        "r1": SamplingParams(temperature=0.0, max_new_tokens=CONSTRAINED_TOKENS, grammar=JSON_GRAMMAR),
        "r3": SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logit_bias=((123, 100.0),)),
        "r4": SamplingParams(
            temperature=0.0,
            max_new_tokens=24,
            ignore_eos=True,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            repetition_penalty=1.3,
        ),
    }
    mixed, runner = _run(mixed_sampling, prompts)
    assert runner.num_graph_steps > 0, "decode steps replayed the CUDA graphs"
    for rid in free:
        assert mixed[rid].token_ids == alone[rid].token_ids, rid
    assert mixed["r3"].token_ids == [123] * 24
    tokenizer = Tokenizer.from_file(str(ensure_tiny_checkpoint() / "tokenizer.json"))
    constrained_text = tokenizer.decode(mixed["r1"].token_ids)
    assert mixed["r1"].finish_reason is FinishReason.STOP, constrained_text
    assert _satisfies_schema(constrained_text), constrained_text
    assert not _satisfies_schema(tokenizer.decode(alone["r1"].token_ids)), "the mask would not be needed"
    eager, _ = _run(mixed_sampling, prompts, cuda_graphs=False, async_scheduling=False)
    assert {rid: r.token_ids for rid, r in eager.items()} == {rid: r.token_ids for rid, r in mixed.items()}
