"""Child processes of the local stack: start, wait until ready, stop exactly what was started."""

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
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class ChildProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] = field(repr=False)

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
        log_path = self.log_dir / f"{name}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
            )
        child = ChildProcess(name=name, argv=argv, log_path=log_path, popen=popen)
        self.children.append(child)
        logger.info("started %s (pid %d), log: %s", name, popen.pid, log_path)
        return child

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

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """SIGTERM in reverse start order (gateway before engines), then SIGKILL what is left."""
        for child in reversed(self.children):
            if child.returncode is None:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in reversed(self.children):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing it", child.name, timeout_s)
                _signal_group(child, signal.SIGKILL)
                child.popen.wait()
        self.children.clear()


def _signal_group(child: ChildProcess, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.popen.pid, sig)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
