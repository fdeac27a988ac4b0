"""One choice's output: token ids from the engine in, text deltas out.

Detokenizes incrementally, applies stop strings (the engine only knows stop token ids), keeps the
token counts and logprobs that belong to the text actually returned.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from m3stack.engine.proto import engine_pb2
from m3stack.gateway.tokenize.detokenizer import IncrementalDetokenizer
from m3stack.gateway.tokenize.stop import StopStringMatcher
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class ChoiceDelta:
    """What one engine response added to choice ``index``."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the choice


class ChoiceDecoder:
    def __init__(
        self,
        index: int,
        tokenizer: ModelTokenizer,
        prompt_ids: Sequence[int],
        stop_strings: Sequence[str],
        skip_special_tokens: bool,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.index = index
        self._detokenizer = IncrementalDetokenizer(
            tokenizer.decoder(skip_special_tokens), prompt_ids, tokenizer.single_token_decoder(skip_special_tokens)
        )
        self._stop = StopStringMatcher(stop_strings)
        self._eos_token_ids = frozenset(eos_token_ids)
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False

    def on_response(self, response: engine_pb2.GenerateResponse) -> ChoiceDelta:
        if response.HasField("complete"):
            return self._on_complete(response.complete)
        return self._on_chunk(response.chunk)

    def _on_chunk(self, chunk: engine_pb2.GenerateChunk) -> ChoiceDelta:
        self.cached_tokens = chunk.cached_tokens
        token_ids = chunk.token_ids
        if len(token_ids) == 1 and not self._stop.active and not chunk.logprobs:
            # Nearly every chunk: one token, no stop strings to watch, no logprobs.
            self.completion_tokens += 1
            return ChoiceDelta(self.index, self._detokenizer.push(token_ids[0]), 1)
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        with_logprobs = len(chunk.logprobs) == len(token_ids)
        delta = ChoiceDelta(self.index, "", 0)
        for position, token_id in enumerate(token_ids):
            self.completion_tokens += 1
            delta.num_tokens += 1
            if with_logprobs:
                logprobs.append(_token_logprob(chunk, position, token_id))
            text, stopped = self._stop.feed(self._detokenizer.push(token_id))
            pieces.append(text)
            if stopped:
                self.finished = True
                delta.finish_reason = "stop"
                delta.stop_reason = self._stop.matched
                break
        delta.text = "".join(pieces)
        delta.logprobs = logprobs
        return delta

    def _on_complete(self, complete: engine_pb2.GenerateComplete) -> ChoiceDelta:
        self.finished = True
        self.cached_tokens = complete.cached_tokens
        # The engine counts what it generated, including a final EOS or stop token it did not send.
        self.completion_tokens = max(self.completion_tokens, complete.completion_tokens)
        text, stopped = self._stop.feed(self._detokenizer.finish())
        delta = ChoiceDelta(self.index, text + self._stop.flush(), 0)
        if stopped:
            delta.finish_reason, delta.stop_reason = "stop", self._stop.matched
            return delta
        delta.finish_reason = FINISH_REASONS.get(complete.finish_reason, "stop")
        if complete.HasField("matched_stop_token_id") and complete.matched_stop_token_id not in self._eos_token_ids:
            delta.stop_reason = complete.matched_stop_token_id
        return delta


def _token_logprob(chunk: engine_pb2.GenerateChunk, position: int, token_id: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if position < len(chunk.top_logprobs):
        entry = chunk.top_logprobs[position]
        top = tuple(zip(entry.token_ids, entry.logprobs, strict=False))
    return TokenLogprob(token_id, chunk.logprobs[position], top)
