"""`m3stack up`'s children: a stop signal that lands while a child is being started waits until the child is
recorded, so the stop that follows stops it too (a real signal, a real child process)."""

import os
import signal

import pytest

from m3stack.local import processes
from m3stack.local.cli import StopSignal, stop_on_signals


def test_a_stop_signal_during_a_start_waits_until_the_child_is_recorded(tmp_path, monkeypatch):
    group = processes.ProcessGroup(tmp_path)
    make_child = processes.ChildProcess

    def signal_while_recording(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: between the spawn and the record
        return make_child(*args, **kwargs)

    monkeypatch.setattr(processes, "ChildProcess", signal_while_recording)
    with pytest.raises(StopSignal, match="SIGINT"), stop_on_signals():
        group.start("child", ["--help"])
    (child,) = group.children  # recorded before the stop unwound the start
    group.stop_all(timeout_s=30)
    assert child.returncode is not None and not group.children
    assert not processes.start_in_progress()


def test_a_stop_signal_outside_a_start_stops_at_once():
    with pytest.raises(StopSignal, match="SIGTERM"), stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the handler raises on delivery
