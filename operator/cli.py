"""Run the Kubernetes operator that reconciles M3Deployment resources."""

import argparse
import logging

from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--namespace", default=None, help="watch one namespace (default: all)")


def run(args: argparse.Namespace) -> int:
    logger.error("the operator is not implemented yet")
    return 1
