"""Stop strings over streamed text, against the obvious whole-text reference."""

import random
import secrets

from m3stack.gateway.tokenize.stop import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Generate one character at a time and stop as soon as the text ends with a stop string."""
    for end in range(1, len(text) + 1):
        complete = [stop for stop in stops if text[:end].endswith(stop)]
        if complete:
            stop = max(complete, key=len)
            return text[: end - len(stop)], stop
    return text, None


def run(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stops)
    shown = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        shown.append(text)
        if stopped:
            return shown, matcher.matched
    shown.append(matcher.flush())
    return shown, None


def test_random_texts_chunkings_and_stops():
    seed = secrets.randbits(32)
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        shown, matched = run(chunks, stops)
        expected, expected_stop = reference(text, stops)
        assert "".join(shown) == expected, (seed, text, stops, chunks)
        assert matched == expected_stop, (seed, text, stops, chunks)
        for stop in stops:
            assert stop not in "".join(shown)


def test_text_is_held_back_only_while_it_may_start_a_stop_string():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The result</") == ("The result", False)
    assert matcher.feed("ans") == ("", False)
    assert matcher.feed("wer is not it") == ("</answer is not it", False)
    assert matcher.feed(" done</answer> tail") == (" done", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_a_stop_string_split_over_many_deltas():
    shown, matched = run(["x", "ST", "O", "P", "y"], ["STOP"])
    assert "".join(shown) == "x" and matched == "STOP"


def test_the_stop_string_completed_first_wins():
    shown, matched = run(["one two three"], ["three", "two"])
    assert "".join(shown) == "one " and matched == "two"
    # "b" is complete before "abcd" is, although "abcd" starts earlier.
    shown, matched = run(["xabcd"], ["abcd", "b"])
    assert "".join(shown) == "xa" and matched == "b"


def test_no_stop_strings_pass_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert not matcher.active
