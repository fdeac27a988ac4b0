"""guidellm, a load generator from PyPI, against `m3stack up`'s processes at a small size: text, image and video
chat requests mixed, streamed, at concurrency 1 and 4, and text completions echoing prompts that hold every
character ``str.splitlines()`` ends lines at (``bench/guidellm_load.py`` at full size records the numbers).
guidellm splits the stream body with ``str.splitlines()`` and counts a request as errored for any framing, HTTP
or limit error, so a regression there fails this test: every request must complete with all its tokens and none
may error."""

import json
from pathlib import Path
from typing import Any

import pytest

from bench.guidellm_load import OUTPUT_TOKENS, run

pytestmark = pytest.mark.xdist_group("guidellm")

REQUESTS = 6  # two of each kind per concurrency
STREAMS = [1, 4]


def check_every_request_answered(row: dict[str, Any]) -> None:
    """guidellm's row: no request errored or was cut short, every one it recorded has all its tokens, and the
    requests it sent add up (at most one left open at its stop, a race of guidellm's that records it nowhere)."""
    assert (row["errored"], row["incomplete"]) == (0, 0), row
    assert row["completed"] + row["open_at_stop"] == REQUESTS and row["open_at_stop"] <= 1, row
    assert row["output_tokens"] == row["completed"] * OUTPUT_TOKENS, row


def served(log_dir: Path, path: str) -> list[int]:
    """The statuses of the gateway's answers to ``path``, from its JSON access log."""
    records = (json.loads(line) for line in (log_dir / "gateway.log").read_text().splitlines() if line.startswith("{"))
    return [record["status"] for record in records if record.get("type") == "access" and record["path"] == path]


def test_guidellm_runs_mixed_text_image_video_load_without_errors(tmp_path):
    rows, extra = run(STREAMS, REQUESTS, tmp_path, tmp_path / "logs")
    assert extra["dataset"] == {"text": 4, "image": 4, "video": 4}
    assert [row["concurrency"] for row in rows] == STREAMS
    for row in rows:
        check_every_request_answered(row)
        assert 2 - row["open_at_stop"] <= min(row["with_image"], row["with_video"]), row
        assert max(row["with_image"], row["with_video"]) <= 2, row
    assert served(tmp_path / "logs", "/v1/chat/completions") == [200] * (REQUESTS * len(STREAMS))


def test_guidellm_reads_streamed_echoes_of_line_separators_without_errors(tmp_path):
    rows, extra = run([4], REQUESTS, tmp_path, tmp_path / "logs", echo=True)
    assert extra["dataset"] == {"text": REQUESTS}
    (row,) = rows
    check_every_request_answered(row)
    assert served(tmp_path / "logs", "/v1/completions") == [200] * REQUESTS
