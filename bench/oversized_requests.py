"""Gateway CPU spent refusing oversized requests, against `m3stack up`'s processes (tiny model, CPU).  Run:

    python -m bench.oversized_requests [--repeats 10] [--out DIR]

Each case sends the same refused request ``--repeats`` times, one after another, and reads the gateway
process's CPU time (user + system, all threads, from /proc) around them; the idle rate measured before is
subtracted.  Cases: bodies over ``--max-request-bytes`` (413; declared by Content-Length, or streamed without
it), prompts whose length proves them over the context (400 from the character bound, before tokenizing) at
several body sizes up to the cap, and the peer, what the gateway spent before the bound: the same text
tokenized (``ModelTokenizer.encode``, timed here in-process, the path a prompt under the bound still takes).
Writes ``bench/results/oversized_requests.json``.
"""

import argparse
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import markdown_table, write_results

logger = logging.getLogger("bench.oversized_requests")

LOOPBACK = "127.0.0.1"
CONTEXT = 4096
ENGINE_ARGS = ("--max-model-len", str(CONTEXT), "--kv-cache-gb", "0.1", "--cpu-threads", "1")
MIB = 2**20


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat_body(model: str, chars: int) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * chars}], "max_tokens": 1}
    ).encode()


def declared_too_large(base_url: str) -> int:
    """Headers announcing a body over the cap, and no body: the gateway answers from the headers alone."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {10**12}\r\nConnection: close\r\n\r\n".encode()
        )
        status_line = connection.makefile("rb").readline()
    return int(status_line.split()[1])


def streamed_too_large(client: httpx.Client, base_url: str, model: str, cap: int) -> int:
    body = chat_body(model, cap)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap applies while the body is read
        for start in range(0, len(body), MIB):
            yield body[start : start + MIB]

    response = client.post(
        f"{base_url}/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    return response.status_code


def measure(pid: int, idle_rate: float, repeats: int, send: Callable[[], int]) -> dict[str, Any]:
    statuses = set()
    wall = []
    cpu_before = process_cpu_s(pid)
    started = time.perf_counter()
    for _ in range(repeats):
        begin = time.perf_counter()
        statuses.add(send())
        wall.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - started
    cpu = process_cpu_s(pid) - cpu_before - idle_rate * elapsed
    return {
        "status": ",".join(str(s) for s in sorted(statuses)),
        "gateway_cpu_ms_per_request": 1000 * max(cpu, 0.0) / repeats,
        "wall_ms_median": 1000 * sorted(wall)[len(wall) // 2],
    }


def run(stack: Any, repeats: int, cap: int) -> list[dict[str, Any]]:
    from m3stack.gateway.tokenize.tokenizer import ModelTokenizer

    model, base_url = stack.served_model_name, stack.base_url
    tokenizer = ModelTokenizer.from_folder(stack.model_dir)
    bound_chars = CONTEXT * tokenizer.max_chars_per_token
    pid = stack.gateway.popen.pid
    cpu_before, quiet = process_cpu_s(pid), 3.0
    time.sleep(quiet)
    idle_rate = (process_cpu_s(pid) - cpu_before) / quiet
    rows = []
    with httpx.Client(timeout=300) as client:

        def post(body: bytes, path: str = "/v1/chat/completions") -> int:
            response = client.post(f"{base_url}{path}", content=body, headers={"Content-Type": "application/json"})
            return response.status_code

        cases: list[tuple[str, int, Callable[[], int]]] = [
            ("Content-Length over the cap", 10**12, lambda: declared_too_large(base_url)),
            ("streamed body over the cap", cap + 1, lambda: streamed_too_large(client, base_url, model, cap)),
        ]
        for size in (bound_chars, *(s * MIB for s in (1, 4, 8, 16, 32) if s * MIB < cap), cap - 4096):
            body = chat_body(model, size)
            cases.append((f"chat prompt of {size} characters (length bound)", len(body), lambda body=body: post(body)))
        for case, body_bytes, send in cases:
            row = {"case": case, "body_bytes": body_bytes, **measure(pid, idle_rate, repeats, send)}
            logger.info("%s", row)
            rows.append(row)
        # The peer: the exact path, tokenizing.  Just under the bound the gateway still tokenizes (that request
        # is measured through the gateway); for the larger texts, the tokenizer alone, as before the bound.
        under = chat_body(model, bound_chars - 1)
        row = {"case": f"chat prompt of {bound_chars - 1} characters (exact count)", "body_bytes": len(under)}
        rows.append({**row, **measure(pid, idle_rate, repeats, lambda: post(under))})
        for size in (1 * MIB, 4 * MIB):
            text = "x" * size
            begin = time.process_time()
            tokenizer.encode(text, add_special_tokens=False)
            rows.append(
                {
                    "case": f"peer: tokenizing {size} characters (the gateway before the bound)",
                    "body_bytes": size,
                    "gateway_cpu_ms_per_request": 1000 * (time.process_time() - begin),
                }
            )
    return rows


def main() -> None:
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint
    from m3stack.gateway.api.config import GatewayConfig
    from m3stack.local.processes import free_port
    from m3stack.local.stack import LocalStack

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-request-bytes", type=int, default=None, help="the gateway's cap (default: its own)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cap = args.max_request_bytes or GatewayConfig.__dataclass_fields__["max_request_bytes"].default
    with tempfile.TemporaryDirectory(prefix="oversized-") as logs:
        stack = LocalStack(
            ensure_tiny_checkpoint(),
            LOOPBACK,
            free_port(LOOPBACK),
            1,
            "cpu",
            Path(logs),
            engine_args=ENGINE_ARGS,
            gateway_args=("--media-workers", "0", "--max-request-bytes", str(cap)),
        )
        try:
            stack.start(engine_timeout_s=600, gateway_timeout_s=300)
            rows = run(stack, args.repeats, cap)
        finally:
            stack.stop()
    columns = ["case", "body_bytes", "status", "gateway_cpu_ms_per_request", "wall_ms_median"]
    logger.info("\n%s", markdown_table(rows, columns))
    extra = {"context": CONTEXT, "max_request_bytes": cap, "load_average_after": os.getloadavg()[0]}
    write_results("oversized_requests", rows, extra, args.out)


if __name__ == "__main__":
    main()
