"""The one GPU run: GPU tests, then every GPU benchmark, each in its own process with a time limit.

On the H200 machine, from the repository root (see CONTRIBUTING.md and ../shared/gpu/README.md):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --out $OUT

    python3 bench/gpu_suite.py --out $OUT --only multi_gpu_float32,multi_gpu_False,multi_gpu_True,\
        multi_gpu_reference,multi_gpu_offload,multi_gpu  # 2 GPUs

``.whl`` holds what the machine lacks: FlashInfer and its two dependencies (``../shared/gpu/fetch-wheels.sh``),
transformers 5.24 (the oracle; 5.25 wants a huggingface_hub the machine lacks), and for the serving benchmark's
engine grpcio >= 1.85.1 (the generated stubs' floor; the machine has 1.84), protobuf, grpcio-health-checking,
prometheus_client, llguidance, opentelemetry-api/-sdk/-semantic-conventions 1.45.2/0.66b2 (the engine's tracing)
and pytest-timeout (``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_17_x86_64 ...``), ~52 MB in all.

Writes under --out: ``logs.tar.gz`` (a log per command) and ``results.tar.gz`` (each benchmark's
``<name>.json``), and prints the benchmarks' tables, pytest's summaries and a line per stage last.
Results are then committed under ``bench/results/``.
"""

import argparse
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
    """Commands run side by side (test files share the GPU well; benchmarks run alone), one time limit."""

    name: str
    argvs: list[list[str]]
    timeout_s: int


def pytest_stage(name: str, files: list[str], timeout_s: int) -> Stage:
    """One pytest process per file, all at once; each test has a time limit well under the stage's, so a
    hung test fails with its stack in the log instead of taking the stage's report with it."""
    python = sys.executable
    per_test = ["-q", "-p", "no:cacheprovider", "-rfE", "--tb=short", f"--timeout={timeout_s // 2}"]
    return Stage(name, [[python, "-m", "pytest", *per_test, f"tests/gpu/{file}"] for file in files], timeout_s)


def stages(results_dir: Path, selected: set[str] | None) -> list[Stage]:
    python = sys.executable
    out = ["--out", str(results_dir)]

    def bench(name: str, *flags: str) -> list[list[str]]:
        return [[python, "-m", f"bench.{name}", *out, *flags]]

    # Each stage fits one 10-minute device call; a call runs the few it names (--only).
    # fmt: off
    all_stages = [
        # A fresh machine's first FlashInfer test pays its JIT build (~90 s with the other files running beside it).
        pytest_stage("pytest", ["test_model_bf16.py", "test_runtime.py", "test_msa_decode.py",
                                "test_msa_prefill.py", "test_offload.py", "test_fused_ops.py",
                                "test_expert_parallel.py", "test_msa_metrics.py"], 260),
        # TP=2 and TP=4 with every rank on the one GPU, too slow beside the files above.  On a fresh machine the
        # first test pays the kernels' compilation: it ran past a 150 s per-test limit once (22:03 UTC).
        pytest_stage("tp_one_gpu", ["test_tensor_parallel_one_gpu.py"], 420),
        # The first context pays the kernels' compilation (~60 s), the second its dense peer's 4x work.
        Stage("msa_prefill", bench("msa_prefill", "--sweep-steps", "merge", "--contexts", "32768,131072",
                                   "--budget-s", "150"), 180),
        Stage("engine_step", bench("engine_step", "--steps", "50"), 90),
        # Sampling controls under CUDA graphs (#28): the captured masks/penalties and the engine with mixed batches;
        # then the decode step with every request under a JSON schema against the free step.  Grammars need a
        # tokenizer of M3's vocabulary size: the o200k_base stand-in (bench/grammar_masks.py), carried in .gpu/.
        pytest_stage("sampling_controls", ["test_sampling_controls.py"], 150),
        Stage("grammar_step", bench("grammar_step", "--vocab", ".gpu/o200k_base.tiktoken.gz"), 150),
        # The full sweep, as four runs that bench.serving.merge joins into serving.json (a device call is capped at
        # 10 minutes).  a, b and d at the spec's 512 output tokens; on a fresh machine the first MSA config pays the
        # kernels' compilation (~35 s engine build, ~90 s warm-up), so a gets two shares.
        Stage("serving_abd", bench("serving", "--name", "serving_abd", "--budget-s", "400", "--configs", "a,b,d",
                                   "--weights", "a=2", "--concurrency", "1,2,4,8,16,32,64", "--output-tokens", "512",
                                   "--requests-per-point", "2", "--long-context", "0"), 420),
        # The naive c runs ~9 tok/s at any concurrency (its 2K-suffix prefill alone takes 2.7 s a request), so
        # a/c is measured at 32 output tokens: c up to 32 (~8 min), c at 64 (~5 min), and a at the same workload.
        Stage("serving_c32", bench("serving", "--name", "serving_c32", "--budget-s", "540", "--configs", "c",
                                   "--concurrency", "1,2,4,8,16,32", "--output-tokens", "32",
                                   "--requests-per-point", "1", "--long-context", "0"), 560),
        Stage("serving_c64", bench("serving", "--name", "serving_c64", "--budget-s", "330", "--configs", "c",
                                   "--concurrency", "64", "--output-tokens", "32", "--requests-per-point", "1",
                                   "--long-context", "0"), 350),
        Stage("serving_a32", bench("serving", "--name", "serving_a32", "--budget-s", "190", "--configs", "a",
                                   "--concurrency", "1,2,4,8,16,32,64", "--output-tokens", "32",
                                   "--requests-per-point", "1", "--long-context", "0"), 210),
        # The a/b points at 1 / 16 / 64 with the shared-page index scan (the 60K prefix's k-index read once per group
        # of 4 requests).
        Stage("serving_ab_shared", bench("serving", "--name", "serving_ab_shared", "--budget-s", "480", "--configs",
                                         "a,b", "--concurrency", "1,16,64", "--output-tokens", "512",
                                         "--requests-per-point", "2", "--long-context", "0", "--shared-page-scan"),
              500),
        # serving_abd's a and b with the clients' requests over one shared GenerateStream, as the gateway sends them
        # (one gRPC message per engine wakeup instead of one per request per step).
        Stage("serving_ab_stream", bench("serving", "--name", "serving_ab_stream", "--budget-s", "390", "--configs",
                                         "a,b", "--weights", "a=2", "--concurrency", "1,2,4,8,16,32,64",
                                         "--output-tokens", "512", "--requests-per-point", "2", "--long-context", "0",
                                         "--engine-stream", "shared"), 410),
        Stage("serving_long", bench("serving", "--name", "serving_long", "--budget-s", "400", "--configs", "a,d",
                                    "--concurrency", "1",
                                    "--output-tokens", "64", "--requests-per-point", "2", "--long-context", "262144",
                                    "--long-output-tokens", "63"), 420),
        # The spec's >= 512K request, offload only: 541 device blocks against 4,096 of context.
        Stage("serving_long512", bench("serving", "--name", "serving_long512", "--budget-s", "225", "--configs", "d",
                                       "--long-configs", "d", "--concurrency", "1", "--output-tokens", "8",
                                       "--requests-per-point", "1", "--long-context", "524288",
                                       "--long-output-tokens", "63"), 245),
        Stage("offload_copy", bench("offload_copy"), 90),
        Stage("moe_routing", bench("moe_routing"), 120),
        Stage("msa_decode", bench("msa_decode"), 420),
        # The targets' cases, the sweep where the 7x target is missed (1M x 1) and at 128K x 8 (split-major scans
        # over a shared prefix).
        Stage("msa_decode_targets", bench("msa_decode", "--contexts", "131072,1048576", "--batches", "1,8",
                                          "--sweep-cases", "1048576x1,131072x8"), 300),
        # Issue 30 in one device call: the decode GPU tests of what changed (PDL, the attention merging the scan's
        # lists, the fp8 k-index with scales), then both MSA benchmarks with the peer's kernels (.peer carried,
        # bench.msa_peer) in the same process, no sweeps.
        Stage("msa_kernels_tests", [[python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
                                     "--timeout=100", "tests/gpu/test_msa_decode.py", "-k",
                                     "merges_the_scan or backend_decode_layers or scaled_fp8 or cuda_graph_replays "
                                     "or test_sparse_decode_attention or decode_graph_replays"]], 140),
        Stage("msa_decode_peer", bench("msa_decode", "--contexts", "131072,524288,1048576", "--batches", "1,8",
                                       "--no-sweep"), 240),
        Stage("msa_prefill_peer", bench("msa_prefill", "--no-sweep", "--contexts", "8192,32768,131072",
                                        "--budget-s", "140"), 170),
        # Issue 30 item 5, not run yet: the 60K-prefix workload at 32 and 64 requests with the optimized engine, the
        # dense one and the optimized one over fp8 caches (config e) in the same run.
        Stage("serving_abe_fp8", bench("serving", "--name", "serving_abe_fp8", "--budget-s", "480", "--configs",
                                       "a,b,e", "--concurrency", "32,64", "--output-tokens", "512",
                                       "--requests-per-point", "2", "--long-context", "0"), 500),
        # Issue 29: M3's MoE layer with MXFP8 weights (the fused kernel and the dequantize + grouped GEMM path)
        # against BF16 in the same run at the targets' sizes, alone on the GPU, in a minute (sizes past the budget
        # are left out, the table still prints); then the kernels', the MXFP8 model's and the engine's GPU tests.
        Stage("mxfp8_moe", bench("mxfp8_moe", "--budget-s", "30", "--tokens", "1,4,16,64,512,2048,8192",
                                 "--rank-tokens", "8,64,8192"), 60),
        pytest_stage("mxfp8_tests", ["test_mxfp8.py"], 200),
        # The dense linears with MXFP8 weights against cuBLAS's bf16 at decode and prefill sizes, the kernel and
        # widening + cuBLAS each (~60 s), and the GEMV's and the MMA tiles' configurations (swap_ab candidates
        # included) at decode sizes (~240 s).
        Stage("mxfp8_linears", bench("mxfp8_linears", "--rows", "1,4,16,64,128,256,2048"), 90),
        Stage("mxfp8_gemv", bench("mxfp8_gemv", "--budget-s", "240"), 280),
        # Issue 29 item 5: the serving benchmark's model in BF16 (a) and MXFP8 (f) in the same run, with dense MLPs
        # and with MoE layers (bench/README.md, "MXFP8 weights (config f)").  a first, with 3 shares of the budget:
        # on a fresh machine its build pays FlashInfer's JIT (~2 minutes), which f then finds built.
        *[Stage(f"serving_af_mxfp8{suffix}", bench("serving", "--name", f"serving_af_mxfp8{suffix}", *moe, "--budget-s",
                                                 "540", "--weights", "a=3", "--configs", "a,f",
                                                 "--concurrency", "1,2,4,8,16,32,64",
                                                 "--output-tokens", "512", "--requests-per-point", "2",
                                                 "--long-context", "0"), 570)
          for suffix, moe in (("", ()), ("_moe", ("--moe",)))],
        # 2 GPUs (kind nvidia-h200-x2): one process per test, one after the other, so a hung NCCL group cannot
        # take the next test down with it.
        # The first bf16 test pays FlashInfer's JIT compilation of the M3-dims kernels (~100 s on a fresh machine).
        # Uncaptured, logs streamed: a rank that dies takes pytest's captured output with it.
        *[Stage(f"multi_gpu_{k}", [[python, "-m", "pytest", "-q", "-s", "-o", "log_cli=true", "--log-cli-level=INFO",
                                    "-p", "no:cacheprovider", "-rfE", "--tb=short", f"--timeout={limit - 20}",
                                    "tests/gpu/test_multi_gpu.py", "-k", k]], limit)
          # Expert parallelism now captures decode graphs on both engines too (it ran eagerly until 2026-12-01).
          for k, limit in (("float32", 100), ("False", 300), ("True", 240), ("reference", 150),
                           ("offload", 240))],
        # Both engines capture decode graphs (and warm up) before the first point.
        Stage("multi_gpu", bench("multi_gpu", "--budget-s", "180"), 260),
    ]
    # fmt: on
    return [s for s in all_stages if selected is None or s.name in selected]


def run_stage(stage: Stage, log_dir: Path) -> tuple[str, float]:
    """Run the stage's commands at once, each into ``<log_dir>/<stage>-<i>.log``; the worst outcome wins."""
    start = time.monotonic()
    logs = [open(log_dir / f"{stage.name}-{i}.log", "w") for i in range(len(stage.argvs))]  # noqa: SIM115
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    for argv, log in zip(stage.argvs, logs, strict=True):
        log.write(f"===== {stage.name}: {' '.join(argv)}\n")
        log.flush()
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env))
    statuses = []
    for proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, stage.timeout_s - (time.monotonic() - start)))
            statuses.append("ok" if code == 0 else f"exit {code}")
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            statuses.append(f"timeout {stage.timeout_s}s")
    for log in logs:
        log.close()
    failed = [status for status in statuses if status != "ok"]
    return (",".join(failed) if failed else "ok"), time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--only", default=None, help="comma-separated stage names")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    results_dir = args.out / "results"
    log_dir = args.out / "logs"
    results_dir.mkdir(exist_ok=True)
    log_dir.mkdir(exist_ok=True)
    selected = set(args.only.split(",")) if args.only else None

    env = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm", "--format=csv"],
                         capture_output=True, text=True)  # fmt: skip
    (log_dir / "nvidia-smi.txt").write_text(env.stdout + env.stderr)
    summary = []
    for stage in stages(results_dir, selected):
        status, seconds = run_stage(stage, log_dir)
        summary.append((stage.name, status, seconds))
        logger.info("%-16s %-14s %6.1fs", stage.name, status, seconds)

    # Two archives (the device call returns a few files): results, and every log.
    with tarfile.open(args.out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(results_dir.iterdir()):
            tar.add(path, arcname=path.name)
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(log_dir.iterdir()):
            tar.add(path, arcname=path.name)
    # The tables the benchmarks printed, pytest's summaries and the stage summary, last (the reply shows the tail).
    report = []
    for path in sorted(log_dir.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        report += [line for line in lines if line.startswith("|")]
        report += [f"{path.stem}: {line}" for line in lines
                   if line.startswith(("FAILED", "ERROR")) or " passed" in line or " failed" in line][-12:]  # fmt: skip
    report += [f"STAGE {name:<16} {status:<14} {seconds:6.1f}s" for name, status, seconds in summary]
    sys.stdout.write("\n".join(report) + "\n")
    return 0 if all(status == "ok" for _, status, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
