"""``m3stack engine`` as a real process on loopback (CPU), for tests of what only a process shows."""

import os
import subprocess
import sys
import time

from m3stack.local.processes import http_ok

LOOPBACK = "127.0.0.1"


def start_engine_process(*flags: str) -> subprocess.Popen:
    """The engine on the CPU, stdout and stderr together in ``process.stdout``."""
    return subprocess.Popen(
        [sys.executable, "-m", "m3stack", "engine", "--device", "cpu", "--host", LOOPBACK, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group: a test may signal the group as a terminal would
    )


def wait_engine_loaded(process: subprocess.Popen, metrics_port: int, timeout_s: float = 180) -> None:
    """Until the engine answers /loaded; fails with its output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the engine exited early:\n{process.stdout.read()}")
        if http_ok(f"http://{LOOPBACK}:{metrics_port}/loaded", timeout_s=1):
            return
        time.sleep(0.1)
    raise AssertionError("the engine never answered /loaded")
