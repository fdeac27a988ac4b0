"""``m3stack up`` on GPUs refuses a model its engines cannot hold, with the figures, before starting any process.

This machine has no GPU: ``nvidia-smi`` (which ``up`` asks for the GPUs' memory) is a stand-in script on PATH
that lists the GPUs as the real one does (``--query-gpu=index,memory.total --format=csv,noheader,nounits``).
"""

import os
import subprocess
import sys
from pathlib import Path


def _fake_nvidia_smi(folder: Path, mib: int) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '0, {mib}\\n'\n")
    script.chmod(0o755)


def _up(tmp_path: Path, mib: int, *args: str) -> subprocess.CompletedProcess:
    _fake_nvidia_smi(tmp_path, mib)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "M3STACK_ENGINE_MAX_MODEL_LEN": "4096"}
    command = [sys.executable, "-m", "m3stack", "up", "--device", "cuda", "--log-dir", str(tmp_path / "logs"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_up_refuses_a_model_too_big_for_the_gpus_with_the_figures(tmp_path) -> None:
    result = _up(tmp_path, 2048)  # a 2 GiB GPU: the tiny model's 2 GiB activation allowance alone is too much
    assert result.returncode == 2, result.stderr
    for figure in ("does not fit --tensor-parallel 1", "per GPU of 1 x 2.0 GiB", "for 4096 tokens", "short"):
        assert figure in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())  # no process started
