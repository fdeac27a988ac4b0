"""guidellm, a load generator from PyPI, against `m3stack up`'s processes at a small size: text, image and video
chat requests mixed, streamed, at concurrency 1 and 4, and text completions echoing prompts that hold every
character ``str.splitlines()`` ends lines at (``bench/guidellm_load.py`` at full size records the numbers).
guidellm splits the stream body with ``str.splitlines()`` and counts a request as errored for any framing, HTTP
or limit error, so a regression there fails this test: every request must complete with all its tokens and none
may error."""

import pytest

from bench.guidellm_load import OUTPUT_TOKENS, run

pytestmark = pytest.mark.xdist_group("guidellm")

REQUESTS = 6  # two of each kind per concurrency
STREAMS = [1, 4]


def test_guidellm_runs_mixed_text_image_video_load_without_errors(tmp_path):
    rows, extra = run(STREAMS, REQUESTS, tmp_path, tmp_path / "logs")
    assert extra["dataset"] == {"text": 4, "image": 4, "video": 4}
    assert [row["concurrency"] for row in rows] == STREAMS
    for row in rows:
        assert (row["completed"], row["errored"], row["incomplete"]) == (REQUESTS, 0, 0), row
        assert (row["with_image"], row["with_video"]) == (2, 2), row
        assert row["output_tokens"] == REQUESTS * OUTPUT_TOKENS, row


def test_guidellm_reads_streamed_echoes_of_line_separators_without_errors(tmp_path):
    rows, extra = run([4], REQUESTS, tmp_path, tmp_path / "logs", echo=True)
    assert extra["dataset"] == {"text": REQUESTS}
    (row,) = rows
    assert (row["completed"], row["errored"], row["incomplete"]) == (REQUESTS, 0, 0), row
    assert row["output_tokens"] == REQUESTS * OUTPUT_TOKENS, row
