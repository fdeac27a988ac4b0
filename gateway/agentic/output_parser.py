"""One choice's M3 output, streamed in any pieces, to OpenAI's parts: content, reasoning, tool calls.

The parser is a state machine over the decoded text (markers kept, see ``m3_format``).  Text is handed on as soon as
no marker can start in it; a tail that could still become a marker waits for the next piece, so the output is the
same however the text is split.  Tool calls stream as OpenAI's deltas: the call's id and name once its invoke tag is
read, then its ``arguments`` JSON as the model writes it: a string argument (by the tool's schema, or any scalar of
a tool without one) character by character as its text arrives, any other argument once its element closes, typed
by the schema; the pieces concatenate to ``json.dumps`` of the arguments.

Nothing the model wrote is dropped.  A block that breaks M3's format (text between invokes, an invoke tag or an
argument left open when the output ends) goes back, as written, to the text it interrupted; a call already
announced keeps the arguments read so far, closed into a valid JSON object (a string argument already streaming
ends where the output stopped).  Tool-call blocks inside the reasoning are calls too: the reasoning goes on after
the block.
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from m3stack.gateway.agentic import m3_format
from m3stack.gateway.agentic.arguments import argument_value, is_text_as_written, matching_close
from m3stack.gateway.agentic.schema_types import property_schema

MAX_NAME_CHARS = 256  # a tool or argument name longer than this is not one: the block is malformed
_THINK_MARKERS = (m3_format.THINK_OPEN, m3_format.THINK_CLOSE)


class OutputStart(Enum):
    """Where the model's output starts, from the end of the rendered prompt."""

    REASONING = auto()  # the prompt opened the reasoning block (thinking enabled)
    CONTENT = auto()  # the prompt closed it (thinking disabled)
    EITHER = auto()  # the model decides (adaptive): <mm:think> opens it, a bare </mm:think> skips it


def output_start(prompt_text: str) -> OutputStart:
    if prompt_text.endswith(m3_format.THINK_OPEN):
        return OutputStart.REASONING
    if prompt_text.endswith(m3_format.THINK_CLOSE):
        return OutputStart.CONTENT
    return OutputStart.EITHER


@dataclass
class ToolCallDelta:
    """A piece of tool call ``index``: its id and name come once, first; ``arguments`` pieces concatenate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedText:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _State(Enum):
    UNDECIDED = auto()
    REASONING = auto()
    CONTENT = auto()
    CALLS = auto()  # inside the tool-call block, between invokes
    INVOKE_NAME = auto()
    INVOKE_BODY = auto()  # between the arguments of an invoke
    ARGUMENT = auto()


class _ArgumentMode(Enum):
    WHOLE = auto()  # handed on typed once its element closes
    UNDECIDED = auto()  # a string, unless its body turns out to be nested elements (then WHOLE)
    STREAMED = auto()  # a string whose characters are handed on as they arrive


@dataclass
class _OpenCall:
    index: int
    parameters: Any  # the tool's JSON schema (None: unknown tool)
    arguments_started: bool = False


class OutputParser:
    def __init__(
        self,
        start: OutputStart,
        tools: Mapping[str, Any] | None,
        new_call_id: Callable[[], str],
        hidden: frozenset[str] = frozenset(),
    ) -> None:
        """``tools``: name -> parameters schema of the request's tools; None: tool calls are not parsed.
        ``hidden``: markers the client's decoding would drop (special tokens with ``skip_special_tokens``): decoded
        for the parser only, they are left out of the content and reasoning it hands on (a block given back keeps
        them, as written)."""
        self._state = {
            OutputStart.REASONING: _State.REASONING,
            OutputStart.CONTENT: _State.CONTENT,
            OutputStart.EITHER: _State.UNDECIDED,
        }[start]
        self._tools = tools
        self._new_call_id = new_call_id
        self._buffer = ""
        self._raw = ""  # the block's text since the last piece handed out (given back if the block breaks)
        self._outer = _State.CONTENT  # the state a tool-call block returns to
        self._call: _OpenCall | None = None
        self._argument = ""
        self._argument_mode = _ArgumentMode.WHOLE
        self._streamed = 0  # characters of a STREAMED argument's body handed on (the body stays in the buffer)
        self._calls = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._text_markers = (m3_format.CALLS_OPEN,) if tools is not None else ()
        self._reasoning_markers = (m3_format.THINK_CLOSE, *self._text_markers)
        # The tokens decoding must keep for this parser.
        self.markers = _THINK_MARKERS + (m3_format.CALL_MARKERS if tools is not None else ())
        self._hidden = tuple(sorted(hidden & set(self.markers), key=len, reverse=True))

    @property
    def called(self) -> bool:
        """Whether a tool call was announced (the choice then finishes with ``tool_calls``)."""
        return self._calls > 0

    def feed(self, text: str) -> ParsedText:
        if self._state is _State.CONTENT and not self._text_markers and not self._buffer and not self._hidden:
            return ParsedText(content=text)  # nothing left to look for
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> ParsedText:
        """The end of the output: whatever was held back, and any block left open given back as text."""
        self._run(final=True)
        return self._take()

    # -------------------------------------------------------------------------------------------

    def _take(self) -> ParsedText:
        parsed = ParsedText("".join(self._content), "".join(self._reasoning), self._deltas)
        self._content, self._reasoning, self._deltas = [], [], []
        return parsed

    def _run(self, final: bool) -> None:
        handlers = {
            _State.UNDECIDED: self._undecided,
            _State.REASONING: self._reasoning_text,
            _State.CONTENT: self._content_text,
            _State.CALLS: self._calls_block,
            _State.INVOKE_NAME: self._invoke_name,
            _State.INVOKE_BODY: self._invoke_body,
            _State.ARGUMENT: self._argument_body,
        }
        while handlers[self._state](final):
            pass

    def _consume(self, length: int) -> str:
        taken, self._buffer = self._buffer[:length], self._buffer[length:]
        return taken

    def _undecided(self, final: bool) -> bool:
        text = self._buffer.lstrip()
        skipped = len(self._buffer) - len(text)
        for marker, state in ((m3_format.THINK_OPEN, _State.REASONING), (m3_format.THINK_CLOSE, _State.CONTENT)):
            if text.startswith(marker):
                self._consume(skipped + len(marker))
                self._state = state
                return True
        if not final and (m3_format.THINK_OPEN.startswith(text) or m3_format.THINK_CLOSE.startswith(text)):
            return False
        self._state = _State.CONTENT
        return True

    def _reasoning_text(self, final: bool) -> bool:
        return self._text(self._reasoning, self._reasoning_markers, final)

    def _content_text(self, final: bool) -> bool:
        return self._text(self._content, self._text_markers, final)

    def _text(self, out: list[str], markers: tuple[str, ...], final: bool) -> bool:
        """Hand on the text before the first marker; at a marker, switch state."""
        found, marker = _first_marker(self._buffer, markers)
        if found < 0:
            keep = 0 if final else _held_suffix(self._buffer, markers + self._hidden)
            if len(self._buffer) > keep:
                out.append(self._visible(self._consume(len(self._buffer) - keep)))
            return False
        if found:
            out.append(self._visible(self._consume(found)))
        self._consume(len(marker))
        if marker == m3_format.THINK_CLOSE:
            self._state = _State.CONTENT
        else:
            self._outer = self._state
            self._raw = marker
            self._state = _State.CALLS
        return True

    def _visible(self, text: str) -> str:
        for marker in self._hidden:
            text = text.replace(marker, "")
        return text

    def _calls_block(self, final: bool) -> bool:
        rest = self._skip_space()
        if rest.startswith(m3_format.INVOKE_OPEN):
            self._raw += self._consume(len(m3_format.INVOKE_OPEN))
            self._state = _State.INVOKE_NAME
            return True
        if rest.startswith(m3_format.CALLS_CLOSE):
            self._consume(len(m3_format.CALLS_CLOSE))
            self._raw = ""
            self._state = self._outer
            return True
        if not final and (m3_format.INVOKE_OPEN.startswith(rest) or m3_format.CALLS_CLOSE.startswith(rest)):
            return False
        return self._malformed()

    def _invoke_name(self, final: bool) -> bool:
        end = self._buffer.find(m3_format.INVOKE_NAME_END, 0, MAX_NAME_CHARS + 1)
        if end < 0:
            # (a lone '"' at the end may be the start of the '">' that ends the name)
            if final or len(self._buffer) > MAX_NAME_CHARS or not _name_like(self._buffer.removesuffix('"')):
                return self._malformed()
            return False
        name = self._buffer[:end]
        if not name or not _name_like(name):
            return self._malformed()
        self._consume(end + len(m3_format.INVOKE_NAME_END))
        index = self._calls
        self._calls += 1
        parameters = self._tools.get(name) if self._tools is not None else None
        self._call = _OpenCall(index, parameters)
        self._deltas.append(ToolCallDelta(index, id=self._new_call_id(), name=name))
        self._raw = ""
        self._state = _State.INVOKE_BODY
        return True

    def _invoke_body(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        rest = self._skip_space()
        if rest.startswith(m3_format.INVOKE_CLOSE):
            self._consume(len(m3_format.INVOKE_CLOSE))
            self._close_call()
            self._state = _State.CALLS
            return True
        if rest.startswith(m3_format.ELEMENT_OPEN) and not rest.startswith(m3_format.ELEMENT_CLOSE):
            start = len(m3_format.ELEMENT_OPEN)
            end = rest.find(">", start, start + MAX_NAME_CHARS + 1)
            name = rest[start:end]
            if end >= 0 and name and _name_like(name):
                self._raw += self._consume(end + 1)
                self._argument = name
                schema = property_schema(call.parameters, name, call.parameters)
                text = is_text_as_written(schema, call.parameters)
                self._argument_mode = _ArgumentMode.UNDECIDED if text else _ArgumentMode.WHOLE
                self._state = _State.ARGUMENT
                return True
            if end >= 0 or final or len(rest) > start + MAX_NAME_CHARS or not _name_like(rest[start:]):
                return self._malformed()
            return False
        if not final and (m3_format.INVOKE_CLOSE.startswith(rest) or m3_format.ELEMENT_OPEN.startswith(rest)):
            return False
        return self._malformed()

    def _argument_body(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        end = matching_close(self._buffer, self._argument, 0)
        if self._argument_mode is _ArgumentMode.UNDECIDED:
            self._argument_mode = _string_or_elements(self._buffer[:end] if end >= 0 else self._buffer, end >= 0)
            if self._argument_mode is _ArgumentMode.STREAMED:
                self._deltas.append(ToolCallDelta(call.index, arguments=self._argument_key(call) + '"'))
                self._streamed = 0
                self._raw = ""  # the element's open tag went out as the start of this argument
        if self._argument_mode is _ArgumentMode.STREAMED:
            return self._string_body(call, end, final)
        if end < 0:
            return self._malformed() if final else False
        body = self._consume(end)
        self._consume(len(m3_format.element_close(self._argument)))
        schema = property_schema(call.parameters, self._argument, call.parameters)
        value = argument_value(body, schema, call.parameters)
        piece = self._argument_key(call) + json.dumps(value, ensure_ascii=False)
        self._deltas.append(ToolCallDelta(call.index, arguments=piece))
        self._raw = ""
        self._state = _State.INVOKE_BODY
        return True

    def _string_body(self, call: _OpenCall, end: int, final: bool) -> bool:
        """Hand on a string argument's text up to its closing tag, or up to a tail that may begin that tag. The
        body stays in the buffer until the tag: nested elements of the same name inside the text keep counting."""
        close = m3_format.element_close(self._argument)
        if end >= 0:
            ready = end
        elif final:
            ready = len(self._buffer)
        else:
            ready = len(self._buffer) - _held_suffix(self._buffer, (close,))
        piece = json.dumps(self._buffer[self._streamed : ready], ensure_ascii=False)[1:-1]
        self._streamed = max(self._streamed, ready)
        if end < 0 and not final:
            if piece:
                self._deltas.append(ToolCallDelta(call.index, arguments=piece))
            return False
        self._deltas.append(ToolCallDelta(call.index, arguments=piece + '"'))
        self._argument_mode = _ArgumentMode.WHOLE
        if end < 0:  # the output ended inside the string: it ends there, and the call with it
            self._buffer = ""
            return self._malformed()
        self._consume(end + len(close))
        self._state = _State.INVOKE_BODY
        return True

    def _argument_key(self, call: _OpenCall) -> str:
        """The JSON before the argument's value: ``{"name": `` or ``, "name": ``."""
        piece = ", " if call.arguments_started else "{"
        call.arguments_started = True
        return f"{piece}{json.dumps(self._argument, ensure_ascii=False)}: "

    def _skip_space(self) -> str:
        """Move leading whitespace into the block's raw text; the rest of the buffer."""
        rest = self._buffer.lstrip()
        if len(rest) < len(self._buffer):
            self._raw += self._consume(len(self._buffer) - len(rest))
        return rest

    def _close_call(self) -> None:
        call = self._call
        assert call is not None
        self._deltas.append(ToolCallDelta(call.index, arguments="}" if call.arguments_started else "{}"))
        self._call = None
        self._raw = ""

    def _malformed(self) -> bool:
        """The block breaks M3's format: its unread text goes back to the text it interrupted."""
        raw, self._raw = self._raw, ""
        if self._call is not None:
            self._close_call()
        if raw:
            (self._reasoning if self._outer is _State.REASONING else self._content).append(raw)
        self._state = self._outer
        return True


def _string_or_elements(body: str, complete: bool) -> _ArgumentMode:
    """A string argument's body that opens with an element is nested elements (typed when it closes); one that
    cannot is text to stream; one too short to tell waits."""
    start = body.lstrip()
    if start.startswith(m3_format.ELEMENT_OPEN):
        return _ArgumentMode.WHOLE
    if not complete and m3_format.ELEMENT_OPEN.startswith(start):
        return _ArgumentMode.UNDECIDED
    return _ArgumentMode.STREAMED


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    best, found = -1, ""
    for marker in markers:
        position = text.find(marker)
        if position >= 0 and (best < 0 or position < best):
            best, found = position, marker
    return best, found


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin a marker (they wait for the next piece)."""
    if not markers:
        return 0
    longest = max(len(marker) for marker in markers)
    firsts = {marker[0] for marker in markers}
    for start in range(max(0, len(text) - longest + 1), len(text)):
        if text[start] in firsts and any(marker.startswith(text[start:]) for marker in markers):
            return len(text) - start
    return 0


def _name_like(text: str) -> bool:
    """Whether ``text`` can be (the start of) a tool or argument name: no markup, quotes or line breaks."""
    return not any(char in text for char in '<>"\n]')
