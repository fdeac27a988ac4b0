"""Run the whole stack on this machine: engines and a gateway on loopback, the tiny default model."""

import argparse
import logging

from m3stack import options
from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--model", default="default", help="HF-layout M3 checkpoint folder, or 'default'")
    opts.add("--host", default="127.0.0.1", help="gateway listen address")
    opts.add("--port", type=options.port, default=8000, help="gateway HTTP port")
    opts.add("--engines", type=options.positive_int, default=1, help="number of engine processes")
    opts.add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the engines run")
    opts.flag("--demo", help="send a text, an image and a video request, print the answers, then exit")


def run(args: argparse.Namespace) -> int:
    logger.error("the local stack is not implemented yet")
    return 1
