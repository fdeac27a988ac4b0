"""Constrained decoding with llguidance: compile a request's grammar on arrival, mask each step, advance, finish.

Why llguidance rather than xgrammar (``bench/grammar_masks.py``; figures in bench/README.md): at M3's vocabulary
(200,064 ids) xgrammar's single-threaded mask of an already compiled grammar is the faster one (median 2-3 us a
token against 13-17 us), but what a step pays is the batch's masks, filled in parallel off the critical path, and
64 of them cost the same order with either (0.3-0.5 ms on 2 cores).  What differs by an order of magnitude is
compilation: xgrammar precomputes a per-grammar token cache for 50-130 ms, llguidance compiles in 2-6 ms and
builds lexer states lazily, so the first request with a grammar pays 60-90 us a token with llguidance and
1.4-1.8 ms with xgrammar, and in agentic traffic every request brings its own tool schemas.  llguidance's Lark
dialect also embeds JSON schemas (``%json{...}``) in free-form grammars, which is what the gateway sends
(engine.proto ``Grammar``).

Lifecycle of a constrained request:

- ``GrammarCompiler.submit`` compiles on a worker thread (never the step loop, nor the server's event loop); the
  server hands the request to the engine once that is done, and a grammar that does not compile is refused with
  ``InvalidRequestError`` naming llguidance's error.  Compiled grammars are cached by text: a request gets a copy
  (``deep_copy``) of a pristine matcher instead of a new compilation.
- Each step that samples for it, ``GrammarMasks.fill`` writes the next-token bitmask of every constrained row
  (llguidance's thread pool, outside the GIL) into a pinned buffer, after the previous step's tokens were applied
  and while the device runs this step's forward (``ModelRunner.sample``), and uploads it into a device buffer of
  fixed address; free rows get all bits set.  The sampler masks the logits on the device (``apply_bitmask``).
- ``Scheduler.update`` advances the matcher with the sampled token; once the grammar accepts nothing more
  (``complete``) the request finishes with STOP.
"""

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.torch as llg_torch
import torch

from m3stack.engine.runtime.errors import EngineError, InvalidRequestError

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept for reuse (a service sees a few schemas many times).
GRAMMAR_CACHE_SIZE = 256
COMPILE_THREADS = 2


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One request's grammar: compiled on a worker thread, then a matcher advanced by each generated token."""

    def __init__(self, text: str, future: concurrent.futures.Future) -> None:
        self.text = text
        self._future = future

    @property
    def ready(self) -> bool:
        return self._future.done()

    def add_done_callback(self, callback) -> None:
        self._future.add_done_callback(lambda _: callback())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The compiled matcher (waits for the compilation); ``InvalidRequestError`` when the grammar is bad."""
        return self._future.result()

    def accept(self, token_id: int) -> bool:
        """Advance by a generated token; False when the grammar rejects it (the matcher is then in error)."""
        return self.matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """No token can follow: the output is a full sentence of the grammar and generation must end."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles Lark grammars against the model's tokenizer (``tokenizer.json`` of the checkpoint folder)."""

    def __init__(
        self,
        tokenizer_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        tokenizer: llguidance.LLTokenizer | None = None,
    ) -> None:
        """``tokenizer``: one already built (benchmarks with a stand-in vocabulary); else read on first use."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._pristine: dict[str, llguidance.LLMatcher] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")

    def submit(self, text: str) -> RequestGrammar:
        """Start compiling ``text``; the returned grammar's ``matcher`` waits for it."""
        return RequestGrammar(text, self._pool.submit(self._compile_or_engine_error, text))

    def _compile_or_engine_error(self, text: str) -> llguidance.LLMatcher:
        """``compile``, with any failure an ``EngineError`` (the engine thread ends the request with it)."""
        try:
            return self.compile(text)
        except EngineError:
            raise
        except Exception as exc:
            logger.exception("grammar compilation failed")
            raise EngineError(f"grammar compilation failed: {type(exc).__name__}: {exc}") from exc

    def compile(self, text: str) -> llguidance.LLMatcher:
        """A fresh matcher of ``text`` (``InvalidRequestError`` with llguidance's message when it does not compile)."""
        tokenizer = self.tokenizer()
        with self._lock:
            pristine = self._pristine.get(text)
        if pristine is None:
            pristine = llguidance.LLMatcher(tokenizer, text, log_level=0)  # compiles outside the GIL
            if pristine.is_error():
                raise InvalidRequestError(f"the grammar does not compile: {pristine.get_error()}")
            with self._lock:
                if len(self._pristine) >= GRAMMAR_CACHE_SIZE:
                    self._pristine.pop(next(iter(self._pristine)))
                self._pristine[text] = pristine
        return pristine.deep_copy()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built once, on first use (about a second at M3's vocabulary size)."""
        with self._lock:
            if self._tokenizer is None:
                if not self.tokenizer_path.is_file():
                    raise InvalidRequestError(
                        f"grammars need the model's tokenizer, and {self.tokenizer_path} does not exist"
                    )
                # llguidance before 1.9 takes one EOS id only (1.6.1 is what the H200 machine has).
                eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_path.read_text(), n_vocab=self.vocab_size, eos_token=eos
                )
                logger.info("grammar tokenizer loaded from %s (%d ids)", self.tokenizer_path, self.vocab_size)
            return self._tokenizer

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMasks:
    """A step's token bitmasks: a pinned host buffer llguidance writes, and a device buffer of fixed address.

    One row per sampling row (at most ``max_rows``), ``ceil(V / 32)`` int32 words, bit ``t % 32`` of word
    ``t // 32`` set when token ``t`` is allowed.  ``fill`` rewrites the host rows of step N+1 only after step N's
    tokens were read back, and those came after step N's mask upload on the stream, so one host buffer suffices.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = bitmask_words(vocab_size)
        host = torch.full((max_rows, words), -1, dtype=torch.int32)
        self.host = host.pin_memory() if device.type == "cuda" else host
        self.device_buffer = torch.full((max_rows, words), -1, dtype=torch.int32, device=device)
        self.executor = llguidance.LLExecutor()

    def fill(self, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
        """The bitmask rows ``[n, words]`` on the device: a grammar row's allowed tokens, all bits for the others
        (free rows, and requests whose grammar already ended: that step's token is dropped)."""
        count = len(grammars)
        host = self.host[:count]
        host.fill_(-1)
        matchers = [(g.matcher, row) for row, g in enumerate(grammars) if g is not None and not g.complete]
        if matchers:
            llg_torch.fill_next_token_bitmask_par(self.executor, matchers, host)
        device = self.device_buffer[:count]
        device.copy_(host, non_blocking=True)
        return device


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf in place (``logits`` [n, V], ``bitmask`` [n, ceil(V / 32)] int32).

    Fixed shapes and no host synchronization, so it can run inside a CUDA graph."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size]
    logits.masked_fill_(allowed == 0, float("-inf"))
