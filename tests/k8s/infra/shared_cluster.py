"""One test control plane (or real-node cluster) shared by every process of a test run (the
pytest-xdist workers).

The first process to acquire() builds the binaries if needed and starts the control plane, under
a file lock the others wait on; each process registers its pid as a holder.  release() drops the
holder, and the last one out stops the control plane.  A small reaper process, started with the
control plane, stops it as well once no holder is alive, so a run that was killed (SIGKILL,
a timeout, a crash) leaves nothing running either.  SharedRealCluster does the same for the
cluster with a real node (realnode.py).

    python3 shared_cluster.py reap STATE_DIR [real-node]   (started by acquire(); not for direct use)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

import controlplane
import realnode
from controlplane import ControlPlane, ControlPlaneError
from node_host import NodeError
from processes import ProcessId

log = logging.getLogger("m3stack.k8s.shared_cluster")

REAP_INTERVAL_S = 1.0
Shared = TypeVar("Shared")


class _SharedCluster(Generic[Shared]):
    """What one test run shares, keyed by a string every process of the run agrees on."""

    KIND = ""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.run_dir = state_dir / "cluster"
        self._holders_file = state_dir / "holders.json"
        self._failure_file = state_dir / "failure.txt"

    @contextlib.contextmanager
    def _locked(self, *, blocking: bool = True, create: bool = True) -> Iterator[bool]:
        """Holds the run's lock; yields False instead when it is busy (blocking=False) or when the
        state folder is gone (create=False: the reaper must not recreate what release removed)."""
        if create:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            try:
                lock_file = stack.enter_context(open(self.state_dir / "lock", "a"))
            except FileNotFoundError:
                yield False
                return
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True

    def _live_holders(self) -> list[ProcessId]:
        try:
            holders = [ProcessId.from_json(value) for value in json.loads(self._holders_file.read_text())]
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        return [holder for holder in holders if holder.alive()]

    def _write_holders(self, holders: list[ProcessId]) -> None:
        self._holders_file.write_text(json.dumps([holder.to_json() for holder in holders]))

    # What is shared: how it starts, is found running, and stops.
    def _start(self) -> Shared:
        raise NotImplementedError

    def _load_running(self) -> Shared | None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def acquire(self) -> Shared:
        """The run's control plane, started (and built, once) by the first caller.  Raises
        ControlPlaneError, also for later callers, when it could not start."""
        with self._locked():
            if self._failure_file.exists():
                raise ControlPlaneError(f"(as for an earlier worker) {self._failure_file.read_text()}")
            shared = self._running()
            if shared is None:
                try:
                    shared = self._start()
                except (ControlPlaneError, NodeError) as error:
                    self._failure_file.write_text(str(error))
                    raise ControlPlaneError(str(error)) from error
                self._start_reaper()
            self._write_holders([*self._live_holders(), ProcessId.current()])
            return shared

    def _running(self) -> Shared | None:
        """What already runs here, or None after clearing any leftovers."""
        if not self.run_dir.exists():
            return None
        shared = self._load_running()
        if shared is None:
            self._stop()
        return shared

    def _start_reaper(self) -> None:
        with open(self.state_dir / "reaper.log", "ab") as reaper_log:
            subprocess.Popen(
                [sys.executable, __file__, "reap", str(self.state_dir), self.KIND],
                stdin=subprocess.DEVNULL,
                stdout=reaper_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def release(self) -> None:
        """Drops this process as a holder; the last holder stops the control plane."""
        with self._locked():
            holders = [holder for holder in self._live_holders() if holder != ProcessId.current()]
            self._write_holders(holders)
            if not holders:
                self._stop_all()

    def _stop_all(self) -> None:
        self._stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def reap(self) -> None:
        """Waits until no holder is alive, then stops the control plane (the reaper's loop)."""
        while self.run_dir.exists():
            time.sleep(REAP_INTERVAL_S)
            with self._locked(blocking=False, create=False) as locked:
                # A holder busy under the lock (starting, registering) is alive by definition.
                if locked and self.run_dir.exists() and not self._live_holders():
                    log.info("no test process holds %s any more: stopping it", self.run_dir)
                    self._stop_all()
                    return


class SharedControlPlane(_SharedCluster[ControlPlane]):
    """The run's control plane with kwok's fake nodes."""

    KIND = "control-plane"

    def _start(self) -> ControlPlane:
        return controlplane.start(self.run_dir, controlplane.binaries_dir(build=True))

    def _load_running(self) -> ControlPlane | None:
        with contextlib.suppress(ControlPlaneError):
            plane = controlplane.load(self.run_dir)
            if controlplane.running(plane):
                return plane
        return None

    def _stop(self) -> None:
        controlplane.stop(self.run_dir)


class SharedRealCluster(_SharedCluster[realnode.RealCluster]):
    """The run's cluster with one real node (realnode.RealCluster): one per machine at a time."""

    KIND = "real-node"

    def __init__(self, state_dir: Path, images_manifest: Path) -> None:
        super().__init__(state_dir)
        self._images_manifest = images_manifest

    def _start(self) -> realnode.RealCluster:
        return realnode.start(
            self.run_dir, controlplane.binaries_dir(build=True), realnode.built_node_binaries(), self._images_manifest
        )

    def _load_running(self) -> realnode.RealCluster | None:
        return realnode.load(self.run_dir) if realnode.running(self.run_dir) else None

    def _stop(self) -> None:
        realnode.stop(self.run_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [k8s-reaper] %(message)s", stream=sys.stderr)
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "reap":
        sys.exit(f"usage: {sys.argv[0]} reap STATE_DIR [{SharedRealCluster.KIND}]")
    state_dir = Path(sys.argv[2])
    if sys.argv[3:] == [SharedRealCluster.KIND]:
        SharedRealCluster(state_dir, images_manifest=Path()).reap()  # stops only: needs no images
    else:
        SharedControlPlane(state_dir).reap()
