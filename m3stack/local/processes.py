"""Child processes of the local stack: start, wait until ready, restart, stop exactly what was started."""

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2

# Starting a child and recording it must not be split by a stop: a stop signal handled in between would leave a
# running child that nothing stops.  The signal handler (``local.cli.stop_on_signals``) asks
# ``start_in_progress()`` and, while a start runs, hands its stop to ``defer_until_started``; the start runs it
# as soon as the child is recorded.  Main thread only, as signal handlers are.
_starts_in_progress = 0
_deferred_stops: list[Callable[[], None]] = []


def start_in_progress() -> bool:
    return _starts_in_progress > 0


def defer_until_started(stop: Callable[[], None]) -> None:
    _deferred_stops.append(stop)


@contextlib.contextmanager
def _recorded_start() -> Iterator[None]:
    global _starts_in_progress
    _starts_in_progress += 1
    try:
        yield
    finally:
        _starts_in_progress -= 1
        if not _starts_in_progress and _deferred_stops:
            stops = list(_deferred_stops)
            _deferred_stops.clear()
            for stop in stops:
                stop()  # raises the handler's exception, now that the child is recorded


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (same socket options as uvicorn's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass
class ChildProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] = field(repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # on top of ours

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ProcessGroup:
    """Starts ``m3stack`` subcommands as children, each in its own session, logging to a file."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[ChildProcess] = []

    def start(self, name: str, subcommand_args: list[str], env: dict[str, str] | None = None) -> ChildProcess:
        argv = [sys.executable, "-m", "m3stack", *subcommand_args]
        with _recorded_start():
            popen = self._spawn(argv, name, env or {})
            child = ChildProcess(name, argv, self.log_dir / f"{name}.log", popen, env or {})
            self.children.append(child)
        return child

    def restart(self, child: ChildProcess) -> ChildProcess:
        """Start ``child``'s command again (same ports, same log file, appended) once it has exited."""
        if child.returncode is None:
            raise RuntimeError(f"{child.name} (pid {child.pid}) is still running; stop it before restarting it")
        with _recorded_start():
            popen = self._spawn(child.argv, child.name, child.env)
            fresh = ChildProcess(child.name, child.argv, child.log_path, popen, child.env)
            self.children = [fresh if c is child else c for c in self.children]
        return fresh

    def _spawn(self, argv: list[str], name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                # Ctrl-C in a terminal reaches the parent only, which then stops the children in order.
                start_new_session=True,
            )
        logger.info("started %s (pid %d), log: %s", name, popen.pid, log_path)
        return popen

    def first_exited(self) -> ChildProcess | None:
        return next((c for c in self.children if c.returncode is not None), None)

    def wait_http_ok(self, child: ChildProcess, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200; fail fast if the child exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.returncode is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.returncode} before it was ready; last log lines:\n"
                    f"{child.log_tail()}"
                )
            if http_ok(url):
                return
            time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"{child.name} was not ready within {timeout_s:.0f}s ({url}); log: {child.log_path}")

    def stop(self, children: Iterable[ChildProcess], timeout_s: float = 30.0) -> None:
        """SIGTERM ``children`` together, wait for all of them, SIGKILL what is left at the deadline."""
        chosen = list(children)
        for child in chosen:
            if child.returncode is None:
                signal_child(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in chosen:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing it", child.name, timeout_s)
                signal_child(child, signal.SIGKILL)
                child.popen.wait()
            signal_child(child, signal.SIGKILL)  # anything of its session it left behind
        self.children = [c for c in self.children if c not in chosen]

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop every child at once (see :meth:`stop`)."""
        self.stop(reversed(self.children), timeout_s)

    def kill_all(self) -> None:
        """SIGKILL every child and reap it: the way out when a clean stop is not wanted."""
        for child in self.children:
            signal_child(child, signal.SIGKILL)
        for child in self.children:
            child.popen.wait()
        self.children.clear()


def signal_child(child: ChildProcess, sig: signal.Signals) -> None:
    """SIGKILL goes to the child's whole session (its own workers too, e.g. the gateway's media processes);
    other signals to the child alone, which stops its workers itself once it has drained."""
    with contextlib.suppress(ProcessLookupError):
        if sig == signal.SIGKILL:
            os.killpg(child.popen.pid, sig)
        else:
            os.kill(child.popen.pid, sig)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
