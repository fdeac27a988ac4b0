"""Run the whole stack on this machine: engines and a gateway on loopback, the tiny default model.

Starts N engine processes and one gateway process (the same ``m3stack engine`` / ``m3stack gateway``
subcommands the containers run), waits until they are ready, prints the URL and examples, and serves
until Ctrl-C (or SIGTERM), which stops the gateway (open streams finish), then the engines.  With
``--demo`` it sends a text, an image and a video request through the OpenAI API, prints the answers and
timings, and exits.  Every other engine or gateway flag can be set through its environment variable
(``M3STACK_ENGINE_KV_CACHE_GB=4``, ``M3STACK_GATEWAY_MEDIA_WORKERS=2``, ...).
"""

import argparse
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from m3stack import options
from m3stack.local import processes
from m3stack.options import OptionGroup

if TYPE_CHECKING:  # the stack module is imported when `up` runs, not for `m3stack --help`
    from m3stack.local.stack import LocalStack

logger = logging.getLogger(__name__)

ENGINE_READY_TIMEOUT_S = 600.0  # first run on CPU includes creating the tiny model
GATEWAY_READY_TIMEOUT_S = 300.0  # the gateway spawns its media worker processes before it is ready
WATCH_INTERVAL_S = 1.0


class StopSignal(BaseException):
    """Ctrl-C or SIGTERM arrived: unwind from wherever we are (starting, serving) and stop the children.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--model", default="default", help="HF-layout M3 checkpoint folder, or 'default' (tiny, random weights)")
    opts.add("--host", default="127.0.0.1", help="gateway listen address")
    opts.add("--port", type=options.port, default=8000, help="gateway HTTP port")
    opts.add("--engines", type=options.positive_int, default=1, help="number of engine processes")
    opts.add(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the engines run; on CUDA several engines split the visible GPUs between them",
    )
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
        raise ValueError(f"--model {model}: no config.json there; give an HF-layout M3 checkpoint folder or 'default'")
    return path


def split_gpus(num_engines: int, visible: list[str]) -> list[dict[str, str]]:
    """Each engine's ``CUDA_VISIBLE_DEVICES``: the visible GPUs split into equal consecutive shares.

    One engine keeps whatever it sees (it may span several GPUs with --tensor-parallel); engines never
    share a GPU, since each one sizes its KV cache from the memory it finds free."""
    if num_engines == 1 or not visible:
        return [{} for _ in range(num_engines)]
    if num_engines > len(visible):
        raise ValueError(f"--engines {num_engines} needs one GPU each, but {len(visible)} are visible")
    share = len(visible) // num_engines
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * share : (i + 1) * share])} for i in range(num_engines)]


def visible_gpus(device: str, num_engines: int) -> list[str]:
    """The CUDA devices the engines may use, as ``CUDA_VISIBLE_DEVICES`` entries ([] on CPU)."""
    if device == "cpu" or num_engines == 1:  # one engine needs no split: skip importing torch here
        return []
    import torch

    count = torch.cuda.device_count()
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return inherited[:count] if inherited else [str(i) for i in range(count)]


def check_engines_fit(model_dir: Path, device: str, engine_envs: list[dict[str, str]]) -> None:
    """On GPUs: a ``SizingError`` (a ValueError) with the figures when the model cannot fit one engine's GPUs, as the
    engine would refuse it, before any process starts.  The engines' settings are their flags' variables
    (``M3STACK_ENGINE_*``); the memory is the smallest of the GPUs ``nvidia-smi`` lists (no check without it)."""
    if device == "cpu":
        return
    memory = smallest_gpu_memory(engine_envs)
    if memory is None:
        return
    from m3stack.engine import cli as engine_cli
    from m3stack.engine.assembly.sizing import check_fits

    parser = argparse.ArgumentParser(add_help=False)
    engine_cli.add_arguments(OptionGroup(parser, "engine"))
    args = parser.parse_args(["--model", str(model_dir), "--device", "cuda"])
    config = engine_cli.engine_config(args, engine_cli.parallel_config(args))
    logger.info("sizing: %s", check_fits(config, memory).summary())


def smallest_gpu_memory(engine_envs: list[dict[str, str]]) -> int | None:
    """Bytes of the smallest GPU the engines see (``nvidia-smi``, MiB), None where it does not answer."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = {
        index.strip(): int(mib) * 2**20 for index, mib in (line.split(",") for line in listed.splitlines() if line)
    }
    seen = [d for env in engine_envs for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or list(sizes)
    chosen = [sizes[d] for d in seen if d in sizes]
    return min(chosen) if chosen else None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into :class:`StopSignal` in the main thread, so a stop is honoured during
    the minutes of startup too; restores the previous handlers on exit."""

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        if processes.start_in_progress():  # a child is being started: stop once it is recorded, so it is stopped
            processes.defer_until_started(lambda: request_stop(signum, None))
            return
        raise StopSignal(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    from m3stack.local.stack import LocalStack

    try:
        with stop_on_signals():
            model_dir = resolve_model(args.model)
            engine_envs = split_gpus(args.engines, visible_gpus(args.device, args.engines))
            check_engines_fit(model_dir, args.device, engine_envs)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    except StopSignal:  # nothing started yet
        return 0
    stack = LocalStack(
        model_dir=model_dir,
        host=args.host,
        port=args.port,
        num_engines=args.engines,
        device=args.device,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        engine_envs=engine_envs,
    )
    logger.info("logs: %s", stack.log_dir)
    try:
        with stop_on_signals():
            return serve(stack, args.demo)
    except StopSignal as exc:
        logger.info("%s: stopping (press Ctrl-C again to kill at once)", exc)
        return 0
    except (OSError, RuntimeError) as exc:  # a port in use, a child that died while starting, a timeout
        logger.error("%s", exc)
        return 1
    finally:
        stop(stack)


def serve(stack: "LocalStack", demo: bool) -> int:
    stack.start(ENGINE_READY_TIMEOUT_S, GATEWAY_READY_TIMEOUT_S)
    if demo:
        from m3stack.local.demo import run_demo

        return run_demo(stack.base_url, stack.served_model_name)
    print_usage(stack.base_url, stack.served_model_name)
    while True:
        time.sleep(WATCH_INTERVAL_S)
        failed = stack.first_exited()
        if failed is not None:
            logger.error("%s exited unexpectedly (code %s); log: %s", failed.name, failed.returncode, failed.log_path)
            return 1


def stop(stack: "LocalStack") -> None:
    """Stop cleanly; a second Ctrl-C (or SIGTERM) while that runs kills every child at once."""
    try:
        with stop_on_signals():
            stack.stop()
    except StopSignal:
        logger.warning("killing every process of the stack")
        stack.kill()
    logger.info("stopped; logs: %s", stack.log_dir)


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
