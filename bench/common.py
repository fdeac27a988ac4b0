"""What every benchmark shares: the device line, the result file format, timing on the GPU."""

import datetime
import json
import logging
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# ``text_config`` of a one-layer model holding M3's MoE layer (hidden 6144, 128 experts of 3072 rows, top-8, a
# 3072-row shared expert): the layer bench.mxfp8_moe and bench.moe_routing time.
M3_MOE = {
    "vocab_size": 200064,
    "hidden_size": 6144,
    "num_hidden_layers": 1,
    "layer_types": ["full_attention"],
    "mlp_layer_types": ["sparse"],
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 3072,
    "shared_intermediate_size": 3072,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
}

logger = logging.getLogger(__name__)


def device_line() -> str:
    """A human-readable description of where the benchmark ran (GPU name and driver, or CPU)."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            count = torch.cuda.device_count()
            return (
                f"{count}x {props.name} ({props.total_memory // 2**20} MiB), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}"
            )
    except ImportError:
        pass
    return f"CPU {platform.processor() or platform.machine()}, {_cpu_count()} cores, Python {platform.python_version()}"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def write_results(
    name: str, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None, out_dir: Path | None = None
) -> Path:
    """Write ``{"device", "date", "command", "rows", ...}`` to ``<out_dir or bench/results>/<name>.json``."""
    payload = {
        "device": device_line(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(shlex.quote(arg) for arg in [Path(sys.executable).name, *sys.argv]),
        # The GPU machine gets a copy of the tree without .git: the call passes the commit it sent.
        "commit": os.environ.get("M3STACK_COMMIT", "unknown"),
        "rows": rows,
        **(extra or {}),
    }
    target_dir = out_dir or RESULTS_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    path = target_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", path)
    return path


def graphed(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after warm-up on a side stream), replayed by the returned callable: how the
    engine runs decode steps, without a launch's CPU cost between kernels."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def int_list(text: str) -> list[int]:
    """A comma-separated command-line list of integers ("1,8,64"): the benchmarks' sizes (an argparse ``type``)."""
    return [int(value) for value in text.split(",")]


def cuda_time_us(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn`` on the GPU in microseconds (triton.testing.do_bench, CUDA events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Rows as a GitHub markdown table (floats to 3 significant digits)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
