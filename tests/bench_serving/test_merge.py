"""bench.serving.merge: runs measured apart (one device call each) merged into one results file."""

import json
import xml.etree.ElementTree as ET

import pytest

from bench.serving.merge import main, merge

DEVICE = "1x NVIDIA H200 (143155 MiB), torch 2.11.0+cu130, CUDA 13.0"


def _run(output_tokens: int, rows: list[tuple[str, int, float | None]], *, device: str = DEVICE,
         suffix: int = 2048, engine_stream: str = "request") -> dict:  # fmt: skip
    """A run's payload; a row with rate None is a point the run skipped for its budget."""
    return {
        "device": device,
        "date": "2026-12-01T18:00:00Z",
        "command": f"python3 -m bench.serving --output-tokens {output_tokens}",
        "model": "random-m3-dims-8-layers",
        "args": {"engine_stream": engine_stream},
        "workload": {
            "prefix_tokens": 60000,
            "suffix_tokens": suffix,
            "output_tokens": output_tokens,
            "token_limit": 200025,
            "seed": 0,
            "requests_per_point": 2,
        },
        "rows": [
            {"config": config, "phase": "warm", "concurrency": c, "output_tok_s": rate}
            if rate is not None
            else {"config": config, "phase": "warm", "concurrency": c, "skipped": "budget"}
            for config, c, rate in rows
        ],
    }


def test_ratios_pair_rows_of_one_workload_and_measured_points_replace_skipped_ones():
    runs = {
        "long_out": _run(512, [("a", 1, 400.0), ("a", 2, 700.0), ("b", 1, 200.0), ("b", 2, 350.0)]),
        "naive": _run(32, [("a", 1, None), ("a", 2, None), ("c", 1, 10.0), ("c", 2, 10.0)]),
        "a_short": _run(32, [("a", 1, 250.0), ("a", 2, 380.0)]),
    }
    rows, extra = merge(runs)

    # a/c divides a's 32-token rate (not its 512-token one) into c's.
    assert extra["ratios"]["a_over_c"] == {"32 out": {"1": 25.0, "2": 38.0}}
    assert extra["ratios"]["a_over_b"] == {"512 out": {"1": 2.0, "2": 2.0}}
    assert extra["targets"]["a_over_c_ge_1.8_every_concurrency"] is True
    assert extra["targets"]["a_over_b_ge_2_at_concurrencies"] == {"512 out": [1, 2]}
    # The skipped a points of the naive run are gone: the a_short run measured them.
    assert not [r for r in rows if "skipped" in r]
    assert {(r["run"], r["workload"]) for r in rows} == {("long_out", "512 out"), ("naive", "32 out"),
                                                         ("a_short", "32 out")}  # fmt: skip
    assert [run["name"] for run in extra["runs"]] == ["long_out", "naive", "a_short"]


def test_a_point_no_run_measured_stays_skipped_and_leaves_the_target_open():
    runs = {
        "naive": _run(32, [("a", 1, 250.0), ("a", 4, None), ("c", 1, 10.0), ("c", 4, 9.0)]),
    }
    rows, extra = merge(runs)
    assert [r for r in rows if "skipped" in r] == [
        {"config": "a", "phase": "warm", "concurrency": 4, "skipped": "budget", "run": "naive", "workload": "32 out"}
    ]
    # c's 4 was measured, a's was not: the every-concurrency target is undecided, and says which point is missing.
    assert extra["targets"]["a_over_c_ge_1.8_every_concurrency"] is None
    assert extra["targets"]["a_over_c_missing_concurrencies"] == [4]


def test_runs_that_cannot_be_compared_are_refused():
    with pytest.raises(ValueError, match="different devices"):
        merge({"x": _run(32, [("a", 1, 1.0)]), "y": _run(32, [("c", 1, 1.0)], device="1x NVIDIA B200")})
    # Same output length, different prompt shape: one label would pair rows of different workloads.
    with pytest.raises(ValueError, match="share a label"):
        merge({"x": _run(32, [("a", 1, 1.0)]), "y": _run(32, [("c", 1, 1.0)], suffix=1024)})


def test_runs_whose_clients_call_differently_are_separate_workloads():
    runs = {
        "per_request": _run(512, [("a", 64, 5760.0), ("b", 64, 2580.0)]),
        "shared": _run(512, [("a", 64, 5930.0), ("b", 64, 2574.0)], engine_stream="shared"),
    }
    _, extra = merge(runs)
    assert set(extra["ratios"]["a_over_b"]) == {"512 out", "512 out, shared stream"}
    assert extra["ratios"]["a_over_b"]["512 out"] == {"64": 5760.0 / 2580.0}


def test_the_cli_writes_the_merged_file_and_plot_with_the_runs_device(tmp_path):
    paths = []
    for name, payload in {"long_out": _run(512, [("a", 1, 400.0), ("b", 1, 200.0)]),
                          "naive": _run(32, [("a", 1, 250.0), ("c", 1, 10.0)])}.items():  # fmt: skip
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(payload))
    assert main(["--out", str(tmp_path), "--name", "merged", *map(str, paths)]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["device"] == DEVICE  # the GPU's, not the CPU machine that merged the files
    assert merged["ratios"]["a_over_c"] == {"32 out": {"1": 25.0}}
    svg = ET.fromstring((tmp_path / "merged.svg").read_text())
    legends = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"a (512 out)", "b (512 out)", "a (32 out)", "c (32 out)"} <= legends
