#!/usr/bin/env bash
# The whole test suite, as `scripts/dev test` runs it (inside the cached environment).
# Extra arguments go to pytest.  Exit code: 0 only when lint passed and pytest ran tests that
# all passed (pytest's "no tests collected", exit 5, is a failure here).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
start=$(date +%s)
status=0

echo "== ruff"
if ! ruff check .; then status=1; fi
# Python files only: the formatter would also rewrite the README's code blocks.
if ! ruff format --check --exclude '*.md' .; then status=1; fi

echo "== k8s test binaries"
# tests/k8s runs on a control plane built from Go modules into $M3STACK_CACHE: about 15 minutes
# once, an instant check after.  Built here, not inside a test's timeout; skipped when the
# arguments name only paths outside tests/k8s.
if ! bash tests/k8s/infra/build --for-pytest "$@" >/dev/null; then status=1; fi

echo "== real-node pieces and images"
# tests/k8s/realnode runs pods on a real node (tests/k8s/README.md): CoreDNS, Traefik and the pause binary from
# Go modules (about 25 minutes once, cached), and this tree's engine, gateway and operator images
# (`scripts/dev images`: about 2 minutes after a code change, seconds when nothing changed). Skipped when the
# arguments name only paths outside tests/k8s/realnode; the node itself needs root (CI runs as root).
if node_dir=$(bash tests/k8s/infra/build --node --for-pytest "$@"); then
  if [[ -n $node_dir ]] && ! scripts/dev images >/dev/null; then status=1; fi
else
  status=1
fi

echo "== pytest"
workers=${M3STACK_TEST_WORKERS:-auto}
# tests/gpu is the GPU suite: it needs CUDA and runs on the H200 through bench/gpu_suite.py.
python -m pytest -n "$workers" --dist loadgroup --ignore=tests/gpu "$@"
pytest_status=$?
if [[ $pytest_status -eq 5 ]]; then
  echo "pytest collected no tests: treating that as a failure"
fi
if [[ $pytest_status -ne 0 ]]; then status=1; fi

elapsed=$(( $(date +%s) - start ))
if [[ $status -eq 0 ]]; then
  echo "SUMMARY: PASS (ruff clean and formatted, pytest exit $pytest_status) in ${elapsed}s"
else
  echo "SUMMARY: FAIL (pytest exit $pytest_status) in ${elapsed}s"
fi
exit $status
