"""`m3stack up` under a real load generator: guidellm (PyPI) at concurrency 1, 8, 32 and 64 with text, image and
video chat requests mixed.  Run:

    python -m bench.guidellm_load [--requests 64] [--streams 1,8,32,64] [--out DIR]

guidellm's OpenAI backend sends `/v1/chat/completions` requests with streaming on; it reads a JSON-lines dataset
whose rows have a ``prompt`` column and, for a third of them each, an ``image`` or a ``video`` column holding a
``data:`` URL: its chat request handler turns those into ``image_url`` and ``video_url`` content parts (guidellm
0.8's ``image_column`` / ``video_column``).  Every image and video is different (no encoder or prefix cache hits).
The stack is the one `m3stack up` starts (one engine and a gateway, the tiny default model, CPU).

Writes ``bench/results/guidellm_load.json``: per concurrency, requests completed and errored, request and output
token throughput, TTFT and inter-token latency percentiles, from guidellm's own report (kept beside it as
``guidellm_load.report.json``, its per-request samples dropped).  ``tests/e2e/test_guidellm.py`` runs it small.
"""

import argparse
import base64
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import int_list, markdown_table, write_results

logger = logging.getLogger("bench.guidellm_load")

LOOPBACK = "127.0.0.1"
ENGINE_ARGS = ("--max-model-len", "2048", "--kv-cache-gb", "0.3", "--max-num-seqs", "64", "--cpu-threads", "1")
OUTPUT_TOKENS = 16
PROMPTS = (
    "Summarise how a paged KV cache works.",
    "Describe what you see, in one sentence.",
    "Why does block-sparse attention scale to long contexts?",
    "What happens in this clip?",
)
KINDS = ("text", "image", "video")
# Every prompt also holds the characters str.splitlines() ends lines at beyond \n and \r, which guidellm uses to
# split the event stream: echoed (``--echo``), they test the gateway's SSE framing.
LINE_BREAKS = "\u2028 \u2029 \x85 \x0b \x0c \x1c \x1d \x1e"


def png_data_url(seed: int, size: int = 96) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def mp4_data_url(seed: int, width: int = 112, height: int = 84, frames: int = 8, fps: int = 2) -> str:
    """A 4 s H.264 clip (4 frames sampled at 1 fps): libx264 keeps the scheduling policy alone (SVT-AV1 would not)."""
    import av

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast"}
        for _ in range(frames):
            frame = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def write_dataset(path: Path, rows: int, first: int = 0, kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    """``rows`` requests, of ``kinds`` in turn, numbered from ``first`` (a run's media are its own); returns how
    many of each kind."""
    counts = dict.fromkeys(kinds, 0)
    with path.open("w") as out:
        for index in range(first, first + rows):
            kind = kinds[index % len(kinds)]
            counts[kind] += 1
            row: dict[str, Any] = {"prompt": f"{PROMPTS[index % len(PROMPTS)]} (request {index}: {LINE_BREAKS})"}
            row["image"] = png_data_url(index) if kind == "image" else None
            row["video"] = mp4_data_url(index) if kind == "video" else None
            out.write(json.dumps(row) + "\n")
    return counts


def scenario(base_url: str, model: str, tokenizer_dir: Path, dataset: Path, streams: int, requests: int,
             report: Path, echo: bool) -> dict[str, Any]:  # fmt: skip
    """guidellm's run configuration: ``requests`` requests at concurrency ``streams``; chat completions, or text
    completions echoing their prompts."""
    # Exactly OUTPUT_TOKENS each (the random-weight model would stop at any EOS it samples).
    body = {"ignore_eos": True, "echo": True} if echo else {"ignore_eos": True}
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url,
                "model": model,
                "request_format": "/v1/completions" if echo else "/v1/chat/completions",
                "max_tokens": OUTPUT_TOKENS,
                "extras": {"body": body},
            },
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "profile": {"kind": "concurrent", "streams": streams},
            "data": [{"kind": "json_file", "path": str(dataset)}],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def run_guidellm(config: dict[str, Any], workdir: Path) -> None:
    scenario_file = workdir / "scenario.json"
    scenario_file.write_text(json.dumps(config, indent=2))
    command = [sys.executable, "-m", "guidellm", "run", "--scenario", str(scenario_file), "--disable-console"]
    logger.info("running %s", " ".join(command))
    subprocess.run(
        command, check=True, cwd=workdir, env={**os.environ, "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    )


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency from guidellm's report."""
    rows = []
    for benchmark in report["benchmarks"]:
        metrics = benchmark["metrics"]
        totals = metrics["request_totals"]

        def pct(name: str, key: str, metrics: dict[str, Any] = metrics) -> float | None:
            distribution = metrics[name]["successful"]
            return distribution["percentiles"].get(key) if distribution else None

        rows.append(
            {
                "concurrency": benchmark["config"]["strategy"]["streams"],
                "completed": totals["successful"],
                "errored": totals["errored"],
                "incomplete": totals["incomplete"],
                # Requests guidellm still held open when its max-requests constraint ended the benchmark: sent and
                # (the gateway's access log shows) answered, but recorded nowhere in its report.  guidellm 0.8 can
                # stop with one open when two responses finish in the same millisecond.
                "open_at_stop": benchmark["scheduler_state"]["processing_requests"],
                "with_image": _successful_count(metrics["image"]["pixels"]["input"]),
                "with_video": _successful_count(metrics["video"]["bytes"]["input"]),
                "output_tokens": metrics["output_token_count"]["successful"]["total_sum"],
                "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
                "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
                "ttft_ms_p50": pct("time_to_first_token_ms", "p50"),
                "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
                "itl_ms_p50": pct("inter_token_latency_ms", "p50"),
                "itl_ms_p99": pct("inter_token_latency_ms", "p99"),
            }
        )
    return rows


def _successful_count(distributions: dict[str, Any] | None) -> int:
    successful = (distributions or {}).get("successful")
    return int(successful["count"]) if successful else 0


def run(
    streams: list[int], requests: int, workdir: Path, log_dir: Path, echo: bool = False
) -> tuple[list[dict[str, Any]], dict]:
    """``echo``: text completions that echo their prompts (line separators included) instead of the chat mix."""
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint
    from m3stack.local.processes import free_port
    from m3stack.local.stack import LocalStack

    model_dir = ensure_tiny_checkpoint()
    stack = LocalStack(model_dir, LOOPBACK, free_port(LOOPBACK), 1, "cpu", log_dir, engine_args=ENGINE_ARGS,
                       gateway_args=("--media-workers", "1"))  # fmt: skip
    kinds = ("text",) if echo else KINDS
    reports, counts = [], dict.fromkeys(kinds, 0)
    try:
        stack.start(engine_timeout_s=600, gateway_timeout_s=300)
        # One guidellm run per concurrency, each on requests of its own: guidellm replays a dataset from its
        # start for every benchmark of a run, and repeated media would hit the gateway's and engine's caches.
        for number, count in enumerate(streams):
            dataset, report_path = workdir / f"requests-{count}.jsonl", workdir / f"guidellm-{count}.json"
            for kind, made in write_dataset(dataset, requests, number * requests, kinds).items():
                counts[kind] += made
            config = scenario(
                stack.base_url, stack.served_model_name, model_dir, dataset, count, requests, report_path, echo
            )
            run_guidellm(config, workdir)
            reports.append(json.loads(report_path.read_text()))
    finally:
        stack.stop()
    report = {**reports[0], "benchmarks": [b for r in reports for b in r["benchmarks"]]}
    return summarize(report), {"dataset": counts, "report": report}


# What the committed copy of guidellm's report keeps of each benchmark's metrics (the rest: scheduling internals).
KEPT_METRICS = (
    "request_totals",
    "requests_per_second",
    "request_latency",
    "prompt_token_count",
    "output_token_count",
    "time_to_first_token_ms",
    "inter_token_latency_ms",
    "output_tokens_per_second",
    "image",
    "video",
)
DROPPED_KEYS = {"requests", "pdf", "percentile_cis", "mean_ci", "warnings"}


def trimmed(value: Any) -> Any:
    """guidellm's report without per-request samples, confidence intervals and unused metrics."""
    if isinstance(value, dict):
        if "request_totals" in value:  # a benchmark's metrics
            value = {key: value[key] for key in KEPT_METRICS if key in value}
        return {key: trimmed(item) for key, item in value.items() if key not in DROPPED_KEYS}
    if isinstance(value, list):
        return [trimmed(item) for item in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency")
    parser.add_argument("--streams", type=int_list, default=[1, 8, 32, 64], help="concurrencies, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    streams = args.streams
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        rows, extra = run(streams, args.requests, Path(tmp), Path(tmp) / "logs")
    columns = [
        "concurrency",
        "completed",
        "errored",
        "with_image",
        "with_video",
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "itl_ms_p50",
        "itl_ms_p99",
    ]
    logger.info("\n%s", markdown_table(rows, columns))
    from importlib.metadata import version

    info = {"guidellm": version("guidellm"), "requests_per_concurrency": args.requests, "dataset": extra["dataset"],
            "output_tokens": OUTPUT_TOKENS, "load_average_after": os.getloadavg()[0]}  # fmt: skip
    path = write_results("guidellm_load", rows, info, args.out)
    path.with_suffix(".report.json").write_text(json.dumps(trimmed(extra["report"]), indent=1) + "\n")


if __name__ == "__main__":
    main()
