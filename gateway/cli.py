"""Run the OpenAI-compatible HTTP gateway in front of one or more engines."""

import argparse
import logging

from m3stack import options
from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--host", default="127.0.0.1", help="HTTP listen address")
    opts.add("--port", type=options.port, default=8000, help="HTTP port")
    opts.add("--engines", type=options.host_port_list, help="comma-separated engine HOST:PORT list")


def run(args: argparse.Namespace) -> int:
    logger.error("the gateway is not implemented yet")
    return 1
