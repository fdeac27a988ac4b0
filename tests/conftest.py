"""Fixtures shared by every test folder."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random-weight M3 checkpoint (HF layout + tokenizer + chat template), read-only.

    Generated once into ``$M3STACK_CACHE/models/tiny-<version>`` and shared by every xdist worker through a
    file lock.  Copy it before changing anything in it.
    """
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()
