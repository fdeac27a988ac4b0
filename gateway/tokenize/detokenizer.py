"""Incremental detokenization: text deltas for a growing list of token ids.

Decoding token by token is wrong twice over: byte-level tokens can hold part of a UTF-8 character,
and decoders such as Metaspace render a token's leading space differently at the start of a text.
So, like vLLM, we decode a short window that starts a few tokens back and emit what the newest
tokens add to it.  Lossy UTF-8 decoding turns an incomplete character at the very end into exactly
one U+FFFD, and nothing before it can change any more: so everything but a final U+FFFD is shown at
once, and that one waits for the next token.  The concatenated deltas plus ``finish()`` equal
``decode(all ids)``.

Each token costs one decode of the window (the previous token and the new one) and, when the window
moves on, the text of the new window: usually the new token alone, which ``decode_one`` (a cache of
single-token texts) answers without decoding.
"""

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# Prompt tokens that seed the window, so the first generated token is rendered in context.
PROMPT_CONTEXT_TOKENS = 5
# While the text keeps ending in U+FFFD (invalid bytes), the window grows; past this many tokens it
# is cut, keeping the last INCOMPLETE_TAIL_TOKENS: a character has at most 4 bytes, so an incomplete
# one at the end started within the last 3 tokens (each token is at least one byte).
MAX_WINDOW_GROWTH = 8
INCOMPLETE_TAIL_TOKENS = 3

Decode = Callable[[Sequence[int]], str]
DecodeOne = Callable[[int], str]  # must equal decode([token_id])


class IncrementalDetokenizer:
    """Feed token ids with ``push``; each call returns the new text that is safe to show."""

    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = (), decode_one: DecodeOne | None = None) -> None:
        self._decode = decode
        self._decode_one = decode_one if decode_one is not None else lambda token_id: decode([token_id])
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHARACTER):
            # The prompt ends inside a character: seeding with it would glue its bytes to ours.
            context, context_text = [], ""
        self._ids = context
        self._window_start = 0  # the decoded window is ids[window_start:]
        self._next_start = len(context)  # where the window starts after the next advance
        self._shown = len(context_text)  # characters of the window's text already shown (or context)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._window_start :])
        incomplete = window_text.endswith(REPLACEMENT_CHARACTER)
        stable = len(window_text) - 1 if incomplete else len(window_text)
        delta = window_text[self._shown : stable]
        self._shown = max(self._shown, stable)
        if not incomplete:
            self._advance(len(self._ids), window_text)
        elif len(self._ids) - self._next_start >= MAX_WINDOW_GROWTH:
            self._advance(len(self._ids) - INCOMPLETE_TAIL_TOKENS, window_text)
        return delta

    def _advance(self, next_start: int, window_text: str) -> None:
        """Start the window at ``next_start`` (a character boundary), keeping the count of shown text."""
        ids = self._ids
        start = self._next_start
        new_window_text = self._decode_one(ids[start]) if start == len(ids) - 1 else self._decode(ids[start:])
        # The new window's text is a suffix of the old one's (at most a leading space shorter).
        self._shown = max(0, self._shown - (len(window_text) - len(new_window_text)))
        self._window_start, self._next_start = self._next_start, next_start

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes to U+FFFD)."""
        window_text = self._decode(self._ids[self._window_start :])
        delta = window_text[self._shown :]
        self._shown = len(window_text)
        return delta
