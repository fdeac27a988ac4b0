"""One choice's output: token ids from the engine in, text deltas out.

Detokenizes incrementally, applies stop strings (the engine only knows stop token ids), keeps the
token counts and logprobs that belong to the text actually returned.  With an output parser (chat requests with
tools or reasoning), the text is split into content, reasoning and tool-call pieces.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from m3stack.gateway.agentic.output_parser import OutputParser, ToolCallDelta
from m3stack.gateway.engine_client.events import Completion, EngineEvent, PromptLogprobs, TokenChunk
from m3stack.gateway.tokenize.detokenizer import Decode, IncrementalDetokenizer
from m3stack.gateway.tokenize.stop import StopStringMatcher
from m3stack.gateway.tokenize.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    # Where the token's text starts in the choice's text (the prompt's, for a prompt token): a token whose text
    # is left out (a skipped special token) or not complete yet (one byte of a character) takes no room.
    text_offset: int = 0


@dataclass
class ChoiceDelta:
    """What one engine response added to choice ``index``."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the choice
    # Once, with the first tokens, when the engine was asked for them: each prompt token, the first without one.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning: str = ""  # with an output parser: reasoning split off the text
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceDecoder:
    def __init__(
        self,
        index: int,
        tokenizer: ModelTokenizer,
        prompt_ids: Sequence[int],
        stop_strings: Sequence[str],
        skip_special_tokens: bool,
        eos_token_ids: Sequence[int] = (),
        output_parser: OutputParser | None = None,
    ) -> None:
        """``output_parser``: splits the text (``tokenizer`` must then keep its markers, ``ModelTokenizer.keeping``)."""
        self.index = index
        self._parser = output_parser
        self._detokenizer = IncrementalDetokenizer(
            tokenizer.decoder(skip_special_tokens), prompt_ids, tokenizer.single_token_decoder(skip_special_tokens)
        )
        self._stop = StopStringMatcher(stop_strings)
        self._decode_prompt = tokenizer.decoder(skip_special_tokens=False)  # as echo writes the prompt
        self._produced = 0  # characters the detokenizer has given: where the next token's text starts
        self._returned = 0  # characters of them returned so far (stop strings hold some back, and cut the rest)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False

    def on_event(self, event: EngineEvent) -> ChoiceDelta:
        if isinstance(event, Completion):
            return self._on_complete(event)
        return self._on_chunk(event)

    def _on_chunk(self, chunk: TokenChunk) -> ChoiceDelta:
        self.cached_tokens = chunk.cached_tokens
        token_ids = chunk.token_ids
        if len(token_ids) == 1 and not self._stop.active and not chunk.logprobs:
            # Nearly every chunk: one token, no stop strings to watch, no logprobs.
            self.completion_tokens += 1
            text = self._detokenizer.push(token_ids[0])
            self._produced += len(text)
            self._returned += len(text)
            return self._parsed(ChoiceDelta(self.index, text, 1))
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        with_logprobs = len(chunk.logprobs) == len(token_ids)
        delta = ChoiceDelta(self.index, "", 0)
        if chunk.prompt_logprobs is not None:
            delta.prompt_logprobs = _prompt_logprobs(self._prompt_ids, chunk.prompt_logprobs, self._decode_prompt)
        for position, token_id in enumerate(token_ids):
            self.completion_tokens += 1
            delta.num_tokens += 1
            if with_logprobs:
                logprobs.append(_token_logprob(chunk, position, token_id, self._produced))
            produced = self._detokenizer.push(token_id)
            self._produced += len(produced)
            text, stopped = self._stop.feed(produced)
            pieces.append(text)
            if stopped:
                self.finished = True
                delta.finish_reason = "stop"
                delta.stop_reason = self._stop.matched
                break
        delta.text = "".join(pieces)
        self._returned += len(delta.text)
        if delta.finish_reason is not None:
            # The text ends before the stop string, which may have begun in an earlier token.
            logprobs = [replace(e, text_offset=min(e.text_offset, self._returned)) for e in logprobs]
        delta.logprobs = logprobs
        return self._parsed(delta)

    def _on_complete(self, complete: Completion) -> ChoiceDelta:
        self.finished = True
        self.cached_tokens = complete.cached_tokens
        # The engine counts what it generated, including a final EOS or stop token it did not send.
        self.completion_tokens = max(self.completion_tokens, complete.completion_tokens)
        text, stopped = self._stop.feed(self._detokenizer.finish())
        delta = ChoiceDelta(self.index, text + self._stop.flush(), 0)
        if stopped:
            delta.finish_reason, delta.stop_reason = "stop", self._stop.matched
            return self._parsed(delta)
        # An aborted stream never gets here (``Generation`` raises first).
        delta.finish_reason = "length" if complete.finish_reason == "length" else "stop"
        stop_id = complete.matched_stop_token_id
        if stop_id is not None and stop_id not in self._eos_token_ids:
            delta.stop_reason = stop_id
        return self._parsed(delta)

    def _parsed(self, delta: ChoiceDelta) -> ChoiceDelta:
        """The delta's text split by the output parser; the last one also takes what the parser held back, and a
        choice that called tools and stopped finishes with ``tool_calls``."""
        parser = self._parser
        if parser is None:
            return delta
        parsed = parser.feed(delta.text)
        delta.text, delta.reasoning, delta.tool_calls = parsed.content, parsed.reasoning, parsed.tool_calls
        if delta.finish_reason is not None:
            rest = parser.finish()
            delta.text += rest.content
            delta.reasoning += rest.reasoning
            delta.tool_calls += rest.tool_calls
            if parser.called and delta.finish_reason == "stop":
                delta.finish_reason = "tool_calls"
        return delta


def _token_logprob(chunk: TokenChunk, position: int, token_id: int, text_offset: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if position < len(chunk.top_logprobs):
        entry = chunk.top_logprobs[position]
        top = tuple(zip(entry.token_ids, entry.logprobs, strict=False))
    return TokenLogprob(token_id, chunk.logprobs[position], top, text_offset)


def _prompt_logprobs(prompt_ids: Sequence[int], message: PromptLogprobs, decode: Decode) -> list[TokenLogprob | None]:
    """The first prompt token has no logprob (None, at offset 0); token i's is ``message.logprobs[i - 1]``, its
    offset where ``decode`` (the echoed prompt's) gives its text."""
    detokenizer = IncrementalDetokenizer(decode)
    offset = len(detokenizer.push(prompt_ids[0]))
    entries: list[TokenLogprob | None] = [None]
    for position, token_id in enumerate(prompt_ids[1:]):
        top = ()
        if position < len(message.top):
            ranked = message.top[position]
            top = tuple(zip(ranked.token_ids, ranked.logprobs, strict=False))
        logprob = message.logprobs[position] if position < len(message.logprobs) else float("nan")
        entries.append(TokenLogprob(token_id, logprob, top, offset))
        offset += len(detokenizer.push(token_id))
    return entries
