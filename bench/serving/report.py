"""What the rows say (pure): per-point summaries, offload counters, ratios between configs, the targets, greedy
agreement, the SVG plot and the tables printed at the end."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

from bench.common import markdown_table
from bench.serving.client import RequestResult
from bench.serving.workload import Workload
from m3stack.engine.offload.metrics import OffloadStats

# --- summaries ----------------------------------------------------------------------------------------------------


def percentiles_ms(values: list[float], name: str) -> dict[str, float | None]:
    have = bool(values)
    return {f"{name}_p{q}_ms": float(np.percentile(values, q)) * 1e3 if have else None for q in (50, 90, 99)}


def summarize(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    output = sum(len(r.tokens) for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "requests": len(results),
        "output_tokens": output,
        "seconds": seconds,
        "output_tok_s": output / seconds if seconds > 0 else None,
        **percentiles_ms([r.ttft_s for r in results], "ttft"),
        **percentiles_ms([x for r in results for x in r.itls_s], "itl"),
        "e2e_p50_ms": float(np.median([r.e2e_s for r in results])) * 1e3 if results else None,
        "prefix_hit_rate": sum(r.cached_tokens for r in results) / prompt if prompt else None,
    }


def offload_delta(before: OffloadStats | None, after: OffloadStats | None) -> dict[str, Any]:
    """The offload counters' change between two snapshots: hot-buffer hit rate, bytes moved, copy rates."""
    if before is None or after is None:
        return {}
    d = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(OffloadStats)}
    lookups = d["hot_hits"] + d["hot_misses"]
    return {
        "offload_hit_rate": d["hot_hits"] / lookups if lookups else None,
        "offload_spilled_blocks": d["spilled_blocks"],
        "offload_spill_bytes": d["spill_bytes"],
        "offload_miss_bytes": d["miss_bytes"],
        "offload_staged_bytes": d["staged_bytes"],
        "offload_churn_rate": d["churned_blocks"] / d["selected_blocks"] if d["selected_blocks"] else None,
        # Timed copies only (eager steps: a replayed CUDA graph's copies cannot be timed).
        "offload_miss_gbps": d["timed_miss_bytes"] / d["miss_copy_seconds"] / 1e9 if d["miss_copy_seconds"] else None,
        "offload_stall_s": d["miss_copy_seconds"],
        "offload_staging_gbps": d["timed_staged_bytes"] / d["staging_seconds"] / 1e9 if d["staging_seconds"] else None,
        "host_blocks_used": after.host_blocks_used,
    }


def decode_rate(times: list[float], first: int, last: int) -> float | None:
    """Tokens per second between token ``first`` and token ``last`` (indices into arrival times)."""
    last = min(last, len(times) - 1)
    if last <= first or times[last] <= times[first]:
        return None
    return (last - first) / (times[last] - times[first])


# --- across configs -----------------------------------------------------------------------------------------------

# The (numerator, denominator) configs whose output tok/s ratios a run reports per concurrency, as "<n>_over_<d>".
RATIOS = (("a", "c"), ("a", "b"), ("d", "a"), ("e", "a"), ("e", "b"), ("f", "a"))


def ratios(rows: list[dict[str, Any]], numerator: str, denominator: str) -> dict[str, float]:
    """``numerator`` / ``denominator`` output tok/s per concurrency measured for both (warm points)."""
    rate = {(r["config"], r["concurrency"]): r.get("output_tok_s") for r in rows if r.get("phase") == "warm"}
    return {
        str(c): rate[(numerator, c)] / rate[(denominator, c)]
        for (name, c) in rate
        if name == numerator and rate.get((numerator, c)) and rate.get((denominator, c))
    }


def target_report(rows: list[dict[str, Any]], workload: Workload, concurrencies: list[int]) -> dict[str, Any]:
    """Each target: met (True/False), or None where a peer is missing (with what was measured)."""
    a_c, a_b = ratios(rows, "a", "c"), ratios(rows, "a", "b")
    copy_rates = [r["offload_miss_gbps"] for r in rows if r.get("offload_miss_gbps")]
    every = [str(c) for c in concurrencies]
    long_enough = workload.prompt_tokens >= 60_000
    return {
        "a_over_c_ge_1.8_every_concurrency": all(a_c[c] >= 1.8 for c in every) if set(every) <= set(a_c) else None,
        "a_over_b_ge_2_at_60k": all(v >= 2.0 for v in a_b.values()) if a_b and long_enough else None,
        "a_over_b_ge_2_at_concurrencies": sorted((int(c) for c, v in a_b.items() if v >= 2.0)) if long_enough else [],
        "offload_miss_copy_ge_40_gbps": min(copy_rates) >= 40.0 if copy_rates else None,
    }


def agreement(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, int]:
    keys = sorted(set(reference) & set(other))
    return {"requests": len(keys), "equal": sum(reference[k] == other[k] for k in keys)}


# --- plot and tables ----------------------------------------------------------------------------------------------

_COLORS = {"a": "#1f77b4", "b": "#ff7f0e", "c": "#2ca02c", "d": "#d62728", "e": "#9467bd", "f": "#8c564b"}
_PANELS = (("output tok/s", "output_tok_s"), ("TTFT p50 (ms)", "ttft_p50_ms"), ("ITL p50 (ms)", "itl_p50_ms"))


def _series(row: dict[str, Any]) -> str:
    return f"{row['config']} ({row['workload']})" if row.get("workload") else row["config"]


def svg_plot(rows: list[dict[str, Any]], title: str) -> str:
    """Warm points per config against concurrency (log2 axis): one panel per metric of ``_PANELS``."""
    width, height, left, top, inner_w, inner_h = 330, 260, 55, 30, 250, 180
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(_PANELS)}" height="{height + 60}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="10" y="16" font-size="13">{title}</text>',
    ]
    warm = [r for r in rows if r.get("phase") == "warm"]
    # Rows of several workloads (bench.serving.merge) plot as one series per config and workload: the first
    # workload's solid, the others' dashed.
    workloads = [w for w, _ in collections.Counter(r.get("workload") or "" for r in warm).most_common()]
    levels = sorted({r["concurrency"] for r in warm}) or [1]
    lo, hi = math.log2(levels[0]), math.log2(levels[-1]) if levels[-1] > levels[0] else math.log2(levels[0]) + 1
    for panel, (label, key) in enumerate(_PANELS):
        x0, y0 = panel * width + left, top + 20
        points = [r for r in warm if isinstance(r.get(key), int | float)]
        peak = max((r[key] for r in points), default=1.0) * 1.1 or 1.0

        def xy(concurrency: int, value: float, x0: float = x0, y0: float = y0, peak: float = peak) -> str:
            x = x0 + (math.log2(concurrency) - lo) / (hi - lo) * inner_w
            return f"{x:.1f},{y0 + inner_h - value / peak * inner_h:.1f}"

        parts.append(f'<rect x="{x0}" y="{y0}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#888"/>')
        parts.append(f'<text x="{x0}" y="{y0 - 6}">{label}</text>')
        for c in levels:
            x = xy(c, 0).split(",")[0]
            parts.append(f'<text x="{x}" y="{y0 + inner_h + 14}" text-anchor="middle">{c}</text>')
        for fraction in (0.0, 0.5, 1.0):
            y = y0 + inner_h - fraction * inner_h
            parts.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{peak * fraction:.3g}</text>')
        legend_x, legend_y = x0 + 8, y0 + inner_h + 30
        for name in sorted({_series(r) for r in points}):
            members = [r for r in points if _series(r) == name]
            color = _COLORS.get(members[0]["config"], "#555")
            dash = ' stroke-dasharray="5 3"' if workloads.index(members[0].get("workload") or "") else ""
            coords = " ".join(xy(c, v) for c, v in sorted((r["concurrency"], r[key]) for r in members))
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
            parts += [f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="3" fill="{color}"/>'
                      for p in coords.split()]  # fmt: skip
            if legend_x + 6 * len(name) > x0 + inner_w:
                legend_x, legend_y = x0 + 8, legend_y + 13
            parts.append(f'<text x="{legend_x}" y="{legend_y}" fill="{color}">{name}</text>')
            legend_x += 12 + 6 * len(name)
        parts.append(f'<text x="{x0 + inner_w / 2}" y="{legend_y + 14}" text-anchor="middle">concurrency</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def tables(rows: list[dict[str, Any]], extra: dict[str, Any], concurrencies: list[int]) -> str:
    """The targets, then markdown tables of the ratios per concurrency, the long runs and the serving points."""
    ratio_rows = [{"concurrency": c, **{k: v.get(str(c)) for k, v in extra["ratios"].items()
                                        if isinstance(v, dict)}} for c in concurrencies]  # fmt: skip
    columns = ["config", "phase", "concurrency", "requests", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
               "itl_p50_ms", "itl_p99_ms", "prefix_hit_rate", "preemptions", "kernel_compiles", "step_ms",
               "loop_cpu_ms_per_step", "engine_cpu_ms_per_step", "offload_hit_rate", "offload_spilled_blocks",
               "skipped", "error"]  # fmt: skip
    long_columns = [
        "config",
        "context",
        "prefill_s",
        "decode_tok_s",
        "eager_decode_tok_s",
        "late_graph_decode_tok_s",
        "graph_misses",
        "offload_hit_rate",
        "offload_miss_gbps",
        "offload_staging_gbps",
        "offload_spilled_blocks",
        "skipped",
        "error",
    ]
    serving = [r for r in rows if r.get("phase") != "long"]
    long = [r for r in rows if r.get("phase") == "long"]
    return (
        f"targets: {extra['targets']}\n\n"
        + markdown_table(ratio_rows, list(ratio_rows[0]))
        + "\n\n"
        + markdown_table(long, long_columns)
        + "\n\n"
        + markdown_table(serving, columns)
        + "\n"
    )
