"""``m3stack up`` as a user runs it: a process that prints where it serves and working examples, serves until
Ctrl-C and then leaves no process behind; ``--demo`` answers a text, an image and a video request and exits 0;
bad input ends it early with a clear message."""

import contextlib
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from m3stack.local.cli import split_gpus
from m3stack.local.processes import free_port
from m3stack.local.stack import http_url
from tests.e2e.conftest import ENGINE_READY_TIMEOUT_S, GATEWAY_READY_TIMEOUT_S
from tests.helpers.serving import poll_until

pytestmark = pytest.mark.xdist_group("e2e_up")

READY_WITHIN_S = ENGINE_READY_TIMEOUT_S + GATEWAY_READY_TIMEOUT_S
# The children's flags come from their environment variables, as a user would set them.
SMALL_ENGINES = {
    "M3STACK_ENGINE_MAX_MODEL_LEN": "1024",
    "M3STACK_ENGINE_KV_CACHE_GB": "0.1",
    "M3STACK_ENGINE_CPU_THREADS": "1",
    "M3STACK_GATEWAY_MEDIA_WORKERS": "1",
}


class UpProcess:
    """``python -m m3stack up ARGS`` in a session of its own (a terminal's Ctrl-C reaches the whole session,
    so :meth:`ctrl_c` signals it all), its output collected line by line."""

    def __init__(self, *args: str, log_dir: Path) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "m3stack", "up", "--device", "cpu", "--log-dir", str(log_dir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **SMALL_ENGINES},
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=1)
            except queue.Empty:
                assert self.popen.poll() is None, f"m3stack up exited ({self.popen.returncode}):\n{self.output}"
                continue
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s:\n{self.output}")

    def descendants(self) -> set[tuple[int, int]]:
        """Every process below ours (engines, gateway, its media workers) as (pid, start time), from /proc's parent
        links: with the start time a pid the system hands to another process later is not taken for ours."""
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = _stat_fields(int(entry.name))
                except (OSError, IndexError, ValueError):
                    continue
        found, frontier = set(), {self.popen.pid}
        while frontier:
            frontier = {pid for pid, fields in stats.items() if int(fields[1]) in frontier} - found
            found |= frontier
        return {(pid, int(stats[pid][_START_TIME])) for pid in found}

    def ctrl_c(self) -> None:
        os.killpg(self.popen.pid, signal.SIGINT)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    def close(self) -> None:
        """Kill what is left (after a failed test): ``up`` and its children, which have sessions of their own."""
        pids = {pid for pid, _ in self.descendants()} | ({self.popen.pid} if self.popen.poll() is None else set())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.popen.wait(30)


_START_TIME = 19  # /proc/PID/stat's starttime (field 22) among the fields after the command name


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def alive(process: tuple[int, int]) -> bool:
    """The process (pid, start time) still running: not gone, not a zombie waiting for a parent that does not
    reap, and its pid not reused by a newer process (pids wrap at 32768 here, quickly on a busy CI run)."""
    pid, start_time = process
    try:
        fields = _stat_fields(pid)
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[_START_TIME]) == start_time


@pytest.fixture
def log_dir(tmp_path) -> Path:
    return tmp_path / "logs"


def test_up_serves_the_printed_examples_until_ctrl_c_stops_every_process(tiny_model_dir, log_dir):
    port = free_port()
    up = UpProcess("--engines", "2", "--port", str(port), log_dir=log_dir)
    try:
        url = up.wait_for_line(r"m3stack is serving at (http://\S+)", READY_WITHIN_S).group(1)
        assert url == f"http://127.0.0.1:{port}"
        time.sleep(0.5)  # the examples follow the URL line
        curl = re.search(r"^\s*(curl .*?\}')$", up.output, re.MULTILINE | re.DOTALL)
        python = re.search(r"^\s*(python -c .*\")$", up.output, re.MULTILINE)
        assert curl and python, up.output
        answer = subprocess.run(
            shlex.split(curl.group(1).replace("\\\n", " ")), capture_output=True, text=True, timeout=120
        )
        assert answer.returncode == 0 and '"chat.completion"' in answer.stdout, answer
        answer = subprocess.run(shlex.split(python.group(1)), capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and answer.stdout.strip(), answer
        children = up.descendants()
        assert len(children) >= 4, "two engines, a gateway and its media worker"
        assert {p.name for p in log_dir.iterdir()} >= {"engine-0.log", "engine-1.log", "gateway.log"}
        up.ctrl_c()
        assert up.wait(120) == 0, up.output
    finally:
        up.close()
    poll_until(lambda: not any(map(alive, children)), 60, "every child of m3stack up to exit")
    assert "stopped" in up.output


def test_up_demo_answers_text_image_and_video_then_exits_0(tiny_model_dir, log_dir):
    up = UpProcess("--demo", "--port", str(free_port()), log_dir=log_dir)
    try:
        assert up.wait(READY_WITHIN_S + 300) == 0, up.output
    finally:
        up.close()
    for kind in ("text", "image", "video"):
        assert re.search(rf"demo {kind}\s+\d+ ms\s+prompt\s+\d+ tokens, completion\s+\d+ tokens", up.output), up.output
    assert "RANDOM weights" in up.output


def test_ctrl_c_while_starting_stops_the_engines(tiny_model_dir, log_dir):
    up = UpProcess("--engines", "2", "--port", str(free_port()), log_dir=log_dir)
    try:
        up.wait_for_line(r"started engine-1", 120)
        children = up.descendants()
        up.ctrl_c()
        assert up.wait(120) == 0, up.output
    finally:
        up.close()
    assert "m3stack is serving" not in up.output
    # `up` has reaped the engines; their own helpers (e.g. multiprocessing's resource tracker) follow
    # once their parent is gone, which takes a moment on a loaded machine.
    try:
        poll_until(lambda: not any(map(alive, children)), 60, "the engines and their helpers to exit")
    except AssertionError as error:
        left = [(pid, _command_line(pid)) for pid, start in children if alive((pid, start))]
        raise AssertionError(f"{error}: still running {left}") from None


def test_a_port_in_use_ends_up_before_any_engine_starts(tiny_model_dir, log_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        up = UpProcess("--port", str(taken.getsockname()[1]), log_dir=log_dir)
        try:
            assert up.wait(120) == 1, up.output
        finally:
            up.close()
    assert "is in use" in up.output and "--port" in up.output
    assert "started engine" not in up.output


def test_a_model_folder_without_config_is_refused(tmp_path, log_dir):
    up = UpProcess("--model", str(tmp_path), log_dir=log_dir)
    try:
        assert up.wait(120) == 2, up.output
    finally:
        up.close()
    assert "config.json" in up.output


@pytest.mark.parametrize(
    ("engines", "visible", "expected"),
    [
        (1, ["0", "1"], [None]),  # one engine sees every GPU (it may span them with --tensor-parallel)
        (2, [], [None, None]),  # CPU
        (2, ["0", "1", "2", "3"], ["0,1", "2,3"]),
        (3, ["4", "6", "7"], ["4", "6", "7"]),  # the inherited CUDA_VISIBLE_DEVICES entries, not 0..n-1
        (2, ["0", "1", "2"], ["0", "1"]),  # equal shares; the odd GPU stays idle
    ],
)
def test_engines_split_the_visible_gpus(engines, visible, expected):
    envs = split_gpus(engines, visible)
    assert [env.get("CUDA_VISIBLE_DEVICES") for env in envs] == expected


def test_more_engines_than_gpus_is_refused():
    with pytest.raises(ValueError, match="--engines 3 needs one GPU each, but 2 are visible"):
        split_gpus(3, ["0", "1"])


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::", "http://[::1]:8000"),
        ("::1", "http://[::1]:8000"),
        ("localhost", "http://localhost:8000"),
    ],
)
def test_printed_url_is_where_a_local_client_connects(host, url):
    assert http_url(host, 8000) == url
