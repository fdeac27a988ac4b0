"""Several serving runs as one results file.

A device call is capped at 10 minutes, so the full sweep (four configs at seven concurrencies; the naive ``c``
alone takes ~8 minutes for 1..32 at 32 output tokens) is measured as several runs of ``python -m bench.serving``
and merged here:

    python -m bench.serving.merge --name serving bench/results/serving_abd.json bench/results/serving_ac32.json ...

Every row keeps its ``run`` (the file's stem) and gains ``workload`` (a label such as ``"512 out"`` or ``"512 out,
shared stream"``).  Ratios are taken between rows of the same workload only (same prompt shape, output tokens,
requests per point and ``--engine-stream``), so c's
rate at 32 output tokens is only ever divided into a's at 32.  A point a run recorded as skipped for its budget
is left out when another run of the same workload measured it.  The runs' own files stay as they are: this one
adds ``"runs"`` (each run's command, date and engines) and recomputes ``ratios``, ``targets`` and the plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, write_results
from bench.serving.report import RATIOS, ratios, svg_plot, target_report
from bench.serving.workload import Workload

logger = logging.getLogger("bench.serving.merge")

PAIRS = tuple((f"{numerator}_over_{denominator}", numerator, denominator) for numerator, denominator in RATIOS)


def _engine_stream(payload: dict[str, Any]) -> str:
    return payload.get("args", {}).get("engine_stream", "request")  # runs before the flag used per-request calls


def workload_label(payload: dict[str, Any]) -> str:
    label = f"{payload['workload']['output_tokens']} out"
    return f"{label}, shared stream" if _engine_stream(payload) == "shared" else label


def workload_key(payload: dict[str, Any]) -> tuple:
    """What must be equal for two runs' rows to be compared: the prompts, the output, how clients call."""
    w = payload["workload"]
    return (payload["model"], w["prefix_tokens"], w["suffix_tokens"], w["output_tokens"], w["requests_per_point"],
            w["seed"], _engine_stream(payload))  # fmt: skip


def merge(runs: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of every run (by name) and the merged extra fields: runs, ratios and targets per workload."""
    labels = {workload_key(payload): workload_label(payload) for payload in runs.values()}
    if len(set(labels.values())) < len(labels):
        raise ValueError(f"different workloads (prompt shape, requests per point) share a label: {labels}")
    devices = {payload["device"] for payload in runs.values()}
    if len(devices) > 1:
        raise ValueError(f"runs from different devices cannot be merged: {sorted(devices)}")

    tagged = [{**row, "run": name, "workload": labels[workload_key(payload)]}
              for name, payload in runs.items() for row in payload["rows"]]  # fmt: skip
    measured = {_point(r) for r in tagged if "skipped" not in r and "error" not in r}
    rows = [r for r in tagged if "skipped" not in r or _point(r) not in measured]

    ratio_table: dict[str, dict[str, dict[str, float]]] = {name: {} for name, _, _ in PAIRS}
    targets: dict[str, dict[str, Any]] = {}
    for key, label in labels.items():
        group = [r for r in rows if r["workload"] == label]
        for name, numerator, denominator in PAIRS:
            found = ratios(group, numerator, denominator)
            if found:
                ratio_table[name][label] = found
        concurrencies = sorted({r["concurrency"] for r in group if r.get("phase") == "warm"})
        prefix, suffix, output = key[1], key[2], key[3]
        targets[label] = target_report(group, Workload(prefix, suffix, output, token_limit=1), concurrencies)
    extra = {
        "runs": [
            {
                "name": name,
                "date": p["date"],
                "command": p["command"],
                "workload": p["workload"],
                "engines": p.get("engines", {}),
            }
            for name, p in runs.items()
        ],
        "ratios": ratio_table,
        "targets": _overall(ratio_table, rows) | {"per_workload": targets},
    }
    return rows, extra


def _point(row: dict[str, Any]) -> tuple:
    return row["workload"], row["config"], row.get("phase"), row.get("concurrency")


def _overall(ratio_table: dict[str, dict[str, dict[str, float]]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets over every workload: a/c at every concurrency any run measured a warm point at."""
    every = sorted({r["concurrency"] for r in rows if r.get("phase") == "warm" and "skipped" not in r})
    a_c = {int(c): v for per in ratio_table["a_over_c"].values() for c, v in per.items()}
    copy_rates = [r["offload_miss_gbps"] for r in rows if r.get("offload_miss_gbps")]
    return {
        "a_over_c_ge_1.8_every_concurrency": all(a_c[c] >= 1.8 for c in every) if set(every) <= set(a_c) else None,
        "a_over_c_missing_concurrencies": [c for c in every if c not in a_c],
        "a_over_b_ge_2_at_concurrencies": {
            label: sorted(int(c) for c, v in per.items() if v >= 2.0) for label, per in ratio_table["a_over_b"].items()
        },
        "offload_miss_copy_ge_40_gbps": min(copy_rates) >= 40.0 if copy_rates else None,
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.serving.merge", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="results files of python -m bench.serving")
    p.add_argument("--name", default="serving", help="merged file stem: <name>.json and <name>.svg")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    runs = {path.stem: json.loads(path.read_text()) for path in args.runs}
    rows, extra = merge(runs)
    first = next(iter(runs.values()))
    (args.out / f"{args.name}.svg").write_text(svg_plot(rows, f"{first['model']}: merged runs"))
    # The device is the runs' (checked equal), not the machine merging them.
    write_results(args.name, rows, extra | {"plot": f"{args.name}.svg", "device": first["device"]}, out_dir=args.out)
    sys.stdout.write(json.dumps(extra["ratios"], indent=1) + "\n" + json.dumps(extra["targets"], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
