"""One real node per machine (node_host.claim_machine): a node whose claimant still runs is never taken for a
leftover, even before it is running (it may be importing images for minutes); a dead claimant's node that no
longer runs is cleaned up and the machine taken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import node_host
import pytest
from node_host import NodeError
from processes import ProcessId

DEAD = ProcessId(os.getpid(), -1)  # a pid with a start time no process has: a claimant that is gone


@pytest.fixture
def owner_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(node_host, "OWNER_DIR", tmp_path / "owner")
    return tmp_path / "owner"


def _record(owner_dir: Path, run_dir: Path, claimant: ProcessId) -> None:
    owner_dir.mkdir(parents=True, exist_ok=True)
    (owner_dir / "owner.json").write_text(json.dumps({"run_dir": str(run_dir), "claimant": claimant.to_json()}))


def test_a_starting_node_of_a_live_claimant_is_waited_for(owner_dir: Path, tmp_path: Path) -> None:
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claimant = ProcessId.of(starting.pid)
        assert claimant is not None
        _record(owner_dir, tmp_path / "theirs", claimant)
        cleaned: list[Path] = []
        with pytest.raises(NodeError, match="another real test node runs"):
            node_host.claim_machine(tmp_path / "mine", lambda _: False, cleaned.append, timeout_s=0)
        assert cleaned == []
        assert node_host.current_owner() == tmp_path / "theirs"
    finally:
        starting.kill()
        starting.wait()


def test_a_dead_claimants_stopped_node_is_cleaned_up(owner_dir: Path, tmp_path: Path) -> None:
    _record(owner_dir, tmp_path / "crashed", DEAD)
    cleaned: list[Path] = []
    node_host.claim_machine(tmp_path / "mine", lambda _: False, cleaned.append, timeout_s=0)
    assert cleaned == [tmp_path / "crashed"]
    assert node_host.current_owner() == tmp_path / "mine"


def test_a_running_node_is_waited_for_after_its_starter_exited(owner_dir: Path, tmp_path: Path) -> None:
    """`realnode.py up` exits once its node runs: the node, not the claimant, keeps the machine then."""
    _record(owner_dir, tmp_path / "by-hand", DEAD)
    with pytest.raises(NodeError):
        node_host.claim_machine(tmp_path / "mine", lambda run_dir: run_dir.name == "by-hand", print, timeout_s=0)
