"""Run the whole stack on this machine: engines and a gateway on loopback, the tiny default model.

Starts N engine processes and one gateway process (the same ``m3stack engine`` / ``m3stack gateway``
subcommands the containers run), waits until they are ready, prints the URL and examples, and serves
until Ctrl-C, which stops everything.  With ``--demo`` it sends a text, an image and a video request
through the OpenAI API, prints the answers and timings, and exits.
"""

import argparse
import logging
import signal
import threading
from pathlib import Path

from m3stack import options
from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)

ENGINE_READY_TIMEOUT_S = 600.0  # first run on CPU includes creating the tiny model
GATEWAY_READY_TIMEOUT_S = 120.0


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--model", default="default", help="HF-layout M3 checkpoint folder, or 'default' (tiny, random weights)")
    opts.add("--host", default="127.0.0.1", help="gateway listen address")
    opts.add("--port", type=options.port, default=8000, help="gateway HTTP port")
    opts.add("--engines", type=options.positive_int, default=1, help="number of engine processes")
    opts.add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the engines run")
    opts.add("--log-dir", default=None, help="folder for the processes' logs (default: a new folder under the cache)")
    opts.flag("--demo", help="send a text, an image and a video request, print the answers, then exit")


def resolve_model(model: str) -> Path:
    """``default`` -> the cached tiny checkpoint (created on first use); else the given folder."""
    if model == "default":
        from m3stack.engine.model.tiny import ensure_tiny_checkpoint

        path = ensure_tiny_checkpoint()
        logger.info("default model: %s (tiny, RANDOM weights: its answers are random tokens)", path)
        return path
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there; give an HF-layout M3 checkpoint folder or 'default'")
    return path


def run(args: argparse.Namespace) -> int:
    from m3stack.local.stack import LocalStack

    model_dir = resolve_model(args.model)
    stack = LocalStack(
        model_dir=model_dir,
        host=args.host,
        port=args.port,
        num_engines=args.engines,
        device=args.device,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stack.start(ENGINE_READY_TIMEOUT_S, GATEWAY_READY_TIMEOUT_S)
        if args.demo:
            from m3stack.local.demo import run_demo

            return run_demo(stack.base_url, stack.served_model_name)
        print_usage(stack.base_url, stack.served_model_name)
        while not stop.wait(1.0):
            failed = stack.processes.first_exited()
            if failed is not None:
                logger.error(
                    "%s exited unexpectedly (code %s); log: %s", failed.name, failed.returncode, failed.log_path
                )
                return 1
        logger.info("stopping")
        return 0
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def print_usage(base_url: str, model_name: str) -> None:
    logger.info(
        "m3stack is serving at %s (Ctrl-C stops it)\n\n"
        "  curl %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        '    -d \'{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}\'\n\n'
        "  python -c \"from openai import OpenAI; c = OpenAI(base_url='%s/v1', api_key='none'); "
        "print(c.chat.completions.create(model='%s', messages=[{'role': 'user', 'content': 'Hello!'}], "
        'max_tokens=16).choices[0].message.content)"\n',
        base_url,
        base_url,
        model_name,
        base_url,
        model_name,
    )
