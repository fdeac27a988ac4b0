"""Background processes named by pid *and* start time, so a recycled pid is never mistaken for
one of ours (and never signalled)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("m3stack.k8s.processes")

# Popen objects of the processes this interpreter launched: polling them reaps them, so they do
# not linger as zombies (which /proc still lists).
_CHILDREN: dict[int, subprocess.Popen] = {}


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None when pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()


@dataclass(frozen=True)
class ProcessId:
    pid: int
    started: int  # field 22 of /proc/<pid>/stat: clock ticks after boot, fixed at fork

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        fields = _stat_fields(pid)
        return None if fields is None else cls(pid, int(fields[19]))

    @classmethod
    def current(cls) -> ProcessId:
        own = cls.of(os.getpid())
        assert own is not None  # we are running
        return own

    def alive(self) -> bool:
        """True while this very process runs; exited, zombie or a different process with the same
        pid all count as gone."""
        child = _CHILDREN.get(self.pid)
        if child is not None and child.poll() is not None:
            return False
        fields = _stat_fields(self.pid)
        return fields is not None and fields[0] != "Z" and int(fields[19]) == self.started

    def to_json(self) -> list[int]:
        return [self.pid, self.started]

    @classmethod
    def from_json(cls, value: Sequence[int]) -> ProcessId:
        return cls(int(value[0]), int(value[1]))


def launch(args: Sequence[str], log_path: Path) -> ProcessId:
    """Starts args in a new session (a Ctrl-C aimed at the caller does not reach it before an
    orderly stop), stdin closed, stdout and stderr appended to log_path."""
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            list(args), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    _CHILDREN[process.pid] = process
    identity = ProcessId.of(process.pid)
    # Read right after fork, the entry exists even if the program already failed (as a zombie).
    assert identity is not None
    return identity


def terminate(processes: Mapping[str, ProcessId], grace_s: float) -> None:
    """SIGTERM to every process still alive, SIGKILL to any still alive after grace_s."""
    ours = {name: process for name, process in processes.items() if process.alive()}
    for process in ours.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(process.alive() for process in ours.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for name, process in ours.items():
        if process.alive():
            log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", name, process.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while any(process.alive() for process in ours.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in ours.values():
        child = _CHILDREN.pop(process.pid, None)
        if child is not None:
            child.wait()
