"""Where the embedded tiny default model lives, without the engine: ``--model default`` names this folder for the
engine, the gateway and ``m3stack up``.

``engine.model.tiny`` writes the checkpoint (the weights need torch); the gateway only reads its tokenizer and chat
template (its image holds the files without the weights), so it finds the folder here, torch-free.
"""

import os
from pathlib import Path

# Bump whenever engine.model.tiny's output changes: the cache then holds the new model beside the old one.
TINY_VERSION = "2"  # 2: the chat template renders M3's system/developer turns, tools, tool calls and thinking


def tiny_checkpoint_dir(cache_root: str | Path | None = None) -> Path:
    """``$M3STACK_CACHE/models/tiny-<TINY_VERSION>`` (default cache ``~/.cache/m3stack``)."""
    root = Path(cache_root or os.environ.get("M3STACK_CACHE") or Path.home() / ".cache" / "m3stack")
    return root.expanduser() / "models" / f"tiny-{TINY_VERSION}"
