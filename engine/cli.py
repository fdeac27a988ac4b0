"""Run one inference engine: load a model, serve engine.proto over gRPC, metrics over HTTP."""

import argparse
import logging

from m3stack import options
from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add(
        "--model", default="default", help="HF-layout M3 checkpoint folder, or 'default' for the embedded tiny model"
    )
    opts.add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    opts.add("--host", default="127.0.0.1", help="gRPC listen address")
    opts.add("--port", type=options.port, default=50051, help="gRPC port")
    opts.add("--metrics-port", type=options.port, default=9400, help="HTTP port for /metrics and /loaded")


def run(args: argparse.Namespace) -> int:
    logger.error("the engine runtime is not implemented yet")
    return 1
