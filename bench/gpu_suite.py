"""The one GPU run: GPU tests, then every GPU benchmark, each in its own process with a time limit.

On the H200 machine, from the repository root (see CONTRIBUTING.md and ../shared/gpu/README.md):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --out $OUT

Writes under --out: ``suite.log`` (everything) and ``results.tar.gz`` (each benchmark's
``<name>.json``), and prints a one-line-per-stage summary last.  Results are then committed under
``bench/results/``.
"""

import argparse
import io
import logging
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

logger = logging.getLogger("gpu_suite")


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    timeout_s: int


def stages(results_dir: Path, selected: set[str] | None) -> list[Stage]:
    python = sys.executable
    out = ["--out", str(results_dir)]
    all_stages = [
        Stage("pytest", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "--timeout=300"], 900),
        Stage("msa_decode", [python, "-m", "bench.msa_decode", *out], 420),
        Stage("msa_prefill", [python, "-m", "bench.msa_prefill", *out], 420),
        Stage("engine_step", [python, "-m", "bench.engine_step", *out], 300),
        Stage("serving", [python, "-m", "bench.serving", *out], 900),
    ]
    return [s for s in all_stages if selected is None or s.name in selected]


def run_stage(stage: Stage, log: io.TextIOBase) -> tuple[str, float]:
    if stage.argv[2:3] == ["bench." + stage.name] and not (ROOT / "bench" / f"{stage.name}.py").exists():
        return "missing", 0.0
    start = time.monotonic()
    log.write(f"\n===== {stage.name}: {' '.join(stage.argv)}\n")
    log.flush()
    try:
        proc = subprocess.run(stage.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=stage.timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timeout {stage.timeout_s}s"
    return status, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--only", default=None, help="comma-separated stage names")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    results_dir = args.out / "results"
    results_dir.mkdir(exist_ok=True)
    selected = set(args.only.split(",")) if args.only else None

    summary = []
    with open(args.out / "suite.log", "w") as log:
        env = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm",
                              "--format=csv"], capture_output=True, text=True)
        log.write(env.stdout + env.stderr)
        for stage in stages(results_dir, selected):
            status, seconds = run_stage(stage, log)
            summary.append((stage.name, status, seconds))
            logger.info("%-12s %-14s %6.1fs", stage.name, status, seconds)

    with tarfile.open(args.out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(results_dir.glob("*.json")):
            tar.add(path, arcname=path.name)
    # Tables the benchmarks printed, and the stage summary, last (the device reply shows the tail).
    tail = (args.out / "suite.log").read_text().splitlines()
    report = [line for line in tail if line.startswith("|")]
    report += [f"STAGE {name:<12} {status:<14} {seconds:6.1f}s" for name, status, seconds in summary]
    sys.stdout.write("\n".join(report) + "\n")
    return 0 if all(status in ("ok", "missing") for _, status, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
