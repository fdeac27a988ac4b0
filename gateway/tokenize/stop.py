"""Stop strings over streamed text: never show a stop string, nor text after it, even when it
arrives split across several deltas."""

from collections.abc import Sequence


class StopStringMatcher:
    """``feed`` returns the text that can be shown and whether a stop string ended the output.

    Text that could be the beginning of a stop string is held back until the next delta decides;
    ``flush`` releases it when generation ends for another reason.  The output ends right before the
    stop string that is complete first, i.e. ends earliest in the text (among those ending at the same
    character, the longest): what generating one character at a time would give, whatever the chunking.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._pending + text
        found = [(index + len(stop), index, stop) for stop in self._stops if (index := buffer.find(stop)) != -1]
        if found:
            _, index, self.matched = min(found)
            self._pending = ""
            self.stopped = True
            return buffer[:index], True
        held = self._held_suffix_length(buffer)
        self._pending = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _held_suffix_length(self, buffer: str) -> int:
        """The longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
