"""Streamed chunks are rendered by hand (a format string around the encoded text): they must be the
exact bytes ``json.dumps`` gives for the chunk, and chat chunks must parse as the openai client's type
(its ``Completion`` type has no null ``finish_reason``, which streamed text completions send)."""

import json
import random
import re

import pytest
from openai.types.chat import ChatCompletionChunk

from m3stack.gateway.api.render import ChunkRenderer, ResponseMeta, error_event
from m3stack.gateway.generation.choice import ChoiceDelta, TokenLogprob
from m3stack.gateway.generation.run import Usage

# Every character str.splitlines() ends a line at, found by asking it (not from a list).
SPLITLINES_BREAKS = [chr(c) for c in range(0x110000) if len(f"a{chr(c)}b".splitlines()) == 2]

# Characters JSON must escape or that are easy to get wrong: quotes, backslashes, control characters,
# the line separators JavaScript treats as newlines, non-ASCII and astral characters.
TRICKY = ['"', "\\", "\r", "\t", "\x00", "\x1f", "\x7f", "é", "漢", "🙂", "/", "</script>", *SPLITLINES_BREAKS]


def random_text(rng: random.Random) -> str:
    pieces = [rng.choice(TRICKY) if rng.random() < 0.5 else chr(rng.randrange(0x20, 0x3000)) for _ in range(12)]
    return "".join(pieces)


def expected_event(kind: str, meta: ResponseMeta, delta: ChoiceDelta, logprobs: object, include_usage: bool) -> bytes:
    """The chunk as a dict, dumped by ``json.dumps`` (what the renderer wrote before it rendered by hand)."""
    choice: dict[str, object] = {"index": delta.index}
    if kind == "chat":
        choice["delta"] = {"content": delta.text}
    else:
        choice["text"] = delta.text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = delta.finish_reason
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    chunk: dict[str, object] = {
        "id": meta.request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }
    if include_usage:
        chunk["usage"] = None
    return b"data: " + escape_line_breaks(json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))) + b"\n\n"


def escape_line_breaks(dumped: str) -> bytes:
    """JSON text with every splitlines() break that it holds raw written as a \\u escape (the same JSON)."""
    breaks = "[" + "".join(SPLITLINES_BREAKS) + "]"
    return re.sub(breaks, lambda match: f"\\u{ord(match.group()):04x}", dumped).encode()


def token_text(token_id: int) -> str:
    return f'tok"{token_id}\n'


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("finish", [(None, None), ("stop", None), ("stop", "\n\n"), ("stop", 7), ("length", None)])
def test_a_text_chunk_is_exactly_what_json_dumps_writes(kind, include_usage, finish):
    rng = random.Random()
    meta = ResponseMeta(f"id-{random_text(rng)}", f"model {random_text(rng)}", rng.randrange(2**31), token_text, False)
    renderer = ChunkRenderer(kind, meta, include_usage, num_choices=3)
    for _ in range(20):
        delta = ChoiceDelta(rng.randrange(3), random_text(rng), 1, finish_reason=finish[0], stop_reason=finish[1])
        event = renderer.delta(delta)
        assert event == expected_event(kind, meta, delta, None, include_usage)
        payload = json.loads(event.removeprefix(b"data: "))
        if kind == "chat":
            assert ChatCompletionChunk.model_validate(payload).choices[0].delta.content == delta.text
        else:
            assert payload["choices"][0]["text"] == delta.text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_chunk_with_logprobs_is_exactly_what_json_dumps_writes(kind):
    rng = random.Random()
    meta = ResponseMeta("cmpl-1", "m", 1, token_text, True)
    renderer = ChunkRenderer(kind, meta, True, num_choices=1)
    # The second token's text starts 2 characters in (the decoder's count, whatever the token's own text).
    entries = [TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.5))), TokenLogprob(6, -1.5, ((6, -1.5),), text_offset=2)]
    delta = ChoiceDelta(0, random_text(rng), 2, entries, finish_reason="length")
    if kind == "chat":
        top = [
            [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())} for t, lp in e.top]
            for e in entries
        ]
        logprobs: object = {
            "content": [
                {"token": token_text(e.token_id), "logprob": e.logprob, "bytes": list(token_text(e.token_id).encode())}
                | {"top_logprobs": top[i]}
                for i, e in enumerate(entries)
            ]
        }
    else:
        logprobs = {
            "tokens": [token_text(5), token_text(6)],
            "token_logprobs": [-0.25, -1.5],
            "top_logprobs": [{token_text(5): -0.25, token_text(9): -2.5}, {token_text(6): -1.5}],
            "text_offset": [0, 2],
        }
    assert renderer.delta(delta) == expected_event(kind, meta, delta, logprobs, True)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_splitlines_break_is_escaped_in_the_event_bytes(kind):
    assert SPLITLINES_BREAKS == ["\n", "\x0b", "\x0c", "\r", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
    breaks = "".join(SPLITLINES_BREAKS)
    texts = [f"a{char}b{char}" for char in SPLITLINES_BREAKS]
    meta = ResponseMeta(f"cmpl-{breaks}", f"m3{breaks}", 1, token_text, False)
    renderer = ChunkRenderer(kind, meta, True, num_choices=len(texts), echo_texts=texts)
    stream = renderer.opening(len(texts)) if kind == "completion" else b""
    stream += b"".join(
        renderer.delta(ChoiceDelta(i, text, 1, "stop", stop_reason=text)) for i, text in enumerate(texts)
    )
    stream += renderer.usage(Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=0))
    stream += error_event({"error": {"message": breaks, "type": "x"}})
    between_events = stream.replace(b"\n\ndata: ", b"").removesuffix(b"\n\n")
    for char in SPLITLINES_BREAKS:
        assert char.encode() not in between_events, f"U+{ord(char):04X} is raw in the events"
    # A client splitting the body with str.splitlines() gets every event whole, on one line.
    lines = [line for line in stream.decode().splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines]
    choices = [payload["choices"][0] for payload in payloads if payload.get("choices")]
    echoed = texts if kind == "completion" else []
    assert [choice["text"] if kind == "completion" else choice["delta"]["content"] for choice in choices] == [
        *echoed,
        *texts,
    ]
    assert payloads[-2]["model"] == meta.model and payloads[-2]["usage"]["total_tokens"] == 7
    assert payloads[-1]["error"]["message"] == breaks


def test_streamed_reasoning_goes_under_both_names():
    """reasoning_content (what the reference stacks' clients read) and reasoning (vLLM's name now), the same text;
    content only when there is some."""
    meta = ResponseMeta("chatcmpl-1", "m3", 1, token_text, False)
    renderer = ChunkRenderer("chat", meta, False, num_choices=1)
    thought = 'a "plan"\u2028 🙂'
    payload = json.loads(renderer.delta(ChoiceDelta(0, "", 1, reasoning=thought)).removeprefix(b"data: "))
    assert payload["choices"][0]["delta"] == {"reasoning_content": thought, "reasoning": thought}
    delta = ChatCompletionChunk.model_validate(payload).choices[0].delta
    assert delta.model_extra == {"reasoning_content": thought, "reasoning": thought} and delta.content is None
    both = json.loads(renderer.delta(ChoiceDelta(0, "x", 1, reasoning="y")).removeprefix(b"data: "))
    assert both["choices"][0]["delta"] == {"content": "x", "reasoning_content": "y", "reasoning": "y"}
