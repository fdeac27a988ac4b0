"""Create M3 checkpoints: ``m3stack model init-tiny [DIR]`` writes the tiny random-weight default model.

Without DIR it fills the shared cache (``$M3STACK_CACHE/models/tiny-<version>``, what ``--model default``
uses) and prints that folder.  The tiny model's outputs are random tokens.
"""

import argparse
import logging
import sys
from pathlib import Path

from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.parser.add_argument("action", choices=["init-tiny"], help="what to do")
    opts.parser.add_argument(
        "path", nargs="?", default=None, help="checkpoint folder (default: the shared cache used by --model default)"
    )


def run(args: argparse.Namespace) -> int:
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint, write_tiny_checkpoint

    if args.path is None:
        folder = ensure_tiny_checkpoint()
    else:
        folder = Path(args.path)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            logger.error("%s exists and is not an empty folder; choose a new path", folder)
            return 2
        write_tiny_checkpoint(folder)
    logger.info("tiny M3 checkpoint with RANDOM weights (its outputs are random tokens) in %s", folder)
    sys.stdout.write(f"{folder}\n")
    return 0
