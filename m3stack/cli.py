"""The ``m3stack`` command: one entry point, one subcommand per component.

Each subcommand lives in its component's ``cli`` module, which exposes
``add_arguments(options: OptionGroup) -> None`` and ``run(args: argparse.Namespace) -> int``.
Those modules import only light dependencies at import time, so ``m3stack gateway --help``
never loads torch.
"""

import argparse
import importlib
import sys
from collections.abc import Sequence

from m3stack import __version__
from m3stack.logs import LOG_FORMATS, configure_logging
from m3stack.options import OptionGroup

# name -> (module, one-line help); order is the order --help lists them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("m3stack.local.cli", "run engines and a gateway on this machine (the local stack)"),
    "engine": ("m3stack.engine.cli", "run one inference engine (gRPC server)"),
    "gateway": ("m3stack.gateway.cli", "run the OpenAI-compatible HTTP gateway"),
    "operator": ("m3stack.operator.cli", "run the Kubernetes operator"),
    "model": ("m3stack.engine.model.cli", "create or inspect model checkpoints"),
    "probe": ("m3stack.probe", "send a chat completion through each gateway and check the answer (helm test)"),
}


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: the operator reads some engine flags out of an M3Deployment's extraArgs (and refuses
    # them beside the CRD field that sets the same thing), which an abbreviation would slip past.
    parser = argparse.ArgumentParser(
        prog="m3stack",
        description="Serve MiniMax-M3-class models on Kubernetes or on one machine.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"m3stack {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR [env: M3STACK_LOG_LEVEL]")
    parser.add_argument(
        "--log-format",
        default=None,
        choices=LOG_FORMATS,
        help="text (default) or json: one JSON object per line [env: M3STACK_LOG_FORMAT]",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=summary, description=module.__doc__, allow_abbrev=False)
        module.add_arguments(OptionGroup(sub, name))
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as exc:  # a bad M3STACK_LOG_FORMAT: exit 2 naming it, as for a bad flag
        parser.error(f"M3STACK_LOG_FORMAT: {exc}")
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
