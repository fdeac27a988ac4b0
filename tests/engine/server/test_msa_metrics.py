"""``m3stack_engine_msa_*`` on a serving engine's /metrics: the blocks the tiny model's MSA layers selected out of
those they could see, and the time of their index scans, by phase; a dense-attention engine never moves them.

The tiny model has 3 MSA layers, blocks of 16 tokens and top-4 selection: a token at position ``p`` sees
``p // 16 + 1`` blocks and attends ``min(4, p // 16 + 1)`` of them.  On the CPU the engine runs the reference
backend, which times every scan: one per phase, MSA layer and step.
"""

import random

from m3stack.proto import engine_pb2 as pb
from tests.helpers.serving import scrape, series

MSA_LAYERS, BLOCK, TOPK = 3, 16, 4
NEW_TOKENS = 6
COUNTERS = ("selected_blocks", "candidate_blocks", "index_scan_seconds", "timed_index_scans",
            "timed_index_scan_tokens")  # fmt: skip


def _serve(server, prompts: list[list[int]]) -> None:
    """One request at a time, so each prompt is one prefill chunk and every later step decodes one token."""
    for index, prompt in enumerate(prompts):
        sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        request = pb.GenerateRequest(request_id=f"msa-{index}", input_ids=prompt, sampling=sampling)
        tokens = [t for response in server.stub.Generate(request, timeout=120) for t in response.chunk.token_ids]
        assert len(tokens) == NEW_TOKENS
    server.wait_idle()


def _msa(server) -> dict[tuple[str, str], float]:
    samples = scrape(f"{server.metrics_url}/metrics")
    return {
        (name, phase): series(samples, f"m3stack_engine_msa_{name}_total", phase=phase)
        for name in COUNTERS
        for phase in ("prefill", "decode")
    }


def _blocks(positions: range) -> tuple[int, int]:
    """(selected, candidate) blocks of one MSA layer over the query tokens at ``positions``."""
    visible = [p // BLOCK + 1 for p in positions]
    return sum(min(TOPK, v) for v in visible), sum(visible)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(380) for _ in range(length)] for length in (150, 30)]


def test_an_msa_engine_counts_its_selected_blocks_and_times_its_scans(make_server):
    server = make_server()
    before = _msa(server)
    prompts = _prompts()
    _serve(server, prompts)
    after = _msa(server)
    delta = {key: after[key] - before[key] for key in after}

    prefill = [_blocks(range(len(p))) for p in prompts]
    # The last sampled token is never fed back: NEW_TOKENS - 1 decode steps per request.
    decode = [_blocks(range(len(p), len(p) + NEW_TOKENS - 1)) for p in prompts]
    for phase, blocks in (("prefill", prefill), ("decode", decode)):
        assert delta["selected_blocks", phase] == MSA_LAYERS * sum(selected for selected, _ in blocks), phase
        assert delta["candidate_blocks", phase] == MSA_LAYERS * sum(candidates for _, candidates in blocks), phase
    # The 150-token prompt is where selection is sparse: past 4 blocks, it attends 4 of them.
    assert delta["selected_blocks", "decode"] < delta["candidate_blocks", "decode"]
    assert delta["selected_blocks", "prefill"] < delta["candidate_blocks", "prefill"]

    scans = {"prefill": MSA_LAYERS * len(prompts), "decode": MSA_LAYERS * len(prompts) * (NEW_TOKENS - 1)}
    assert delta["timed_index_scans", "prefill"] == scans["prefill"]
    assert delta["timed_index_scan_tokens", "prefill"] == MSA_LAYERS * sum(len(p) for p in prompts)
    assert delta["timed_index_scans", "decode"] == delta["timed_index_scan_tokens", "decode"] == scans["decode"]
    for phase, count in scans.items():
        # Above zero, and below a second per scan of the tiny model.
        assert 0 < delta["index_scan_seconds", phase] < count, phase


def test_a_dense_attention_engine_leaves_them_at_zero(make_server):
    server = make_server(attention="dense")
    _serve(server, _prompts())
    assert set(_msa(server).values()) == {0.0}
