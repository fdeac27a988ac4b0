"""Create or inspect M3 checkpoints (``m3stack model init-tiny DIR``)."""

import argparse
import logging

from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.parser.add_argument("action", choices=["init-tiny"], help="what to do")
    opts.parser.add_argument("path", help="checkpoint folder")


def run(args: argparse.Namespace) -> int:
    logger.error("checkpoint tools are not implemented yet")
    return 1
