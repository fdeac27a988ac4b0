"""The local stack (``m3stack.local.stack.LocalStack``, what ``m3stack up`` runs) as real processes on
loopback, on the tiny default checkpoint on CPU.

``stack`` is one stack for the session (two engines, a gateway with one media worker) shared by the API and
load tests, which are all in the xdist group ``e2e`` so that one worker runs them and the stack starts
once.  The fault tests start their own with :func:`start_stack`.
"""

from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from bench.local_load import ENGINE_ARGS
from m3stack.local.processes import free_port
from m3stack.local.stack import LOOPBACK, LocalStack
from tests.helpers.serving import TEST_HEALTH_ARGS, Samples, scrape

ENGINE_READY_TIMEOUT_S = 600.0  # many engineers share two cores: torch alone can take a minute to import
GATEWAY_READY_TIMEOUT_S = 300.0


def start_stack(
    model_dir: Path,
    log_dir: Path,
    engines: int,
    engine_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> LocalStack:
    """A started local stack on a free port; stopped again if it cannot start."""
    stack = LocalStack(
        model_dir,
        LOOPBACK,
        free_port(LOOPBACK),
        engines,
        "cpu",
        log_dir,
        engine_args=[*ENGINE_ARGS, *engine_args],
        gateway_args=[*TEST_HEALTH_ARGS, *gateway_args],
    )
    try:
        stack.start(ENGINE_READY_TIMEOUT_S, GATEWAY_READY_TIMEOUT_S)
    except BaseException:
        stack.stop()
        raise
    return stack


def openai_client(stack: LocalStack, timeout_s: float = 300.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=timeout_s)


def gateway_metrics(stack: LocalStack) -> Samples:
    return scrape(f"{stack.base_url}/metrics")


def engine_metrics(stack: LocalStack, index: int) -> Samples:
    return scrape(f"{stack.engines[index].probe_url}/metrics")


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[LocalStack]:
    running = start_stack(tiny_model_dir, tmp_path_factory.mktemp("e2e-stack-logs"), 2, (), ("--media-workers", "1"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def client(stack) -> openai.OpenAI:
    return openai_client(stack)


@pytest.fixture(scope="session")
def model_name(stack) -> str:
    return stack.served_model_name


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
