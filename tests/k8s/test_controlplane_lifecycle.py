"""The control plane's failure paths: a component that cannot start is named with its log and the
rest is stopped; a test run that is killed leaves no component running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import controlplane
import pytest
from controlplane import INFRA_DIR, ControlPlane, ControlPlaneError
from processes import ProcessId

POISON = "refusing to start: poisoned by the test"


def test_a_component_that_cannot_start_is_named_and_the_others_are_stopped(
    k8s_cluster: ControlPlane, tmp_path: Path
) -> None:
    binaries = tmp_path / "binaries"
    (binaries / "bin").mkdir(parents=True)
    (binaries / "share").symlink_to(k8s_cluster.share_dir)
    for binary in k8s_cluster.bin_dir.iterdir():
        (binaries / "bin" / binary.name).symlink_to(binary)
    poisoned = binaries / "bin" / "kube-apiserver"
    poisoned.unlink()
    poisoned.write_text(f"#!/bin/sh\necho '{POISON}' >&2\nexit 3\n")
    poisoned.chmod(0o755)
    run_dir = tmp_path / "run"

    with pytest.raises(ControlPlaneError) as raised:
        controlplane.start(run_dir, binaries, timeout_s=60)

    message = str(raised.value)
    assert "kube-apiserver exited" in message
    assert POISON in message
    recorded = controlplane.load(run_dir)  # kept after a failure, for its logs
    assert set(recorded.processes) == {"etcd", "kube-apiserver"}
    assert not any(process.alive() for process in recorded.processes.values())


HOLDER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from shared_cluster import SharedControlPlane
plane = SharedControlPlane(Path(sys.argv[2])).acquire()
print(json.dumps({name: process.to_json() for name, process in plane.processes.items()}), flush=True)
time.sleep(600)
"""


def test_a_killed_test_run_leaves_nothing_running(k8s_cluster: ControlPlane, tmp_path: Path) -> None:
    """A process holding a shared control plane dies by SIGKILL, so no finalizer of its own runs:
    the reaper started with the control plane stops every component and removes its folder."""
    state_dir = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(INFRA_DIR), str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = holder.stdout.readline() if holder.stdout else ""
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert line, f"the holder exited ({holder.returncode}) before its control plane was up"
    processes = {name: ProcessId.from_json(value) for name, value in json.loads(line).items()}
    assert set(processes) == set(controlplane.COMPONENTS)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (state_dir.exists() or any(p.alive() for p in processes.values())):
        time.sleep(0.2)
    still_running = [name for name, process in processes.items() if process.alive()]
    assert not still_running, f"still running 60 s after the holder was killed: {still_running}"
    assert not state_dir.exists()
