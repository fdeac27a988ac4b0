"""Real gateways in front of the tiny CPU engine on loopback, and a load generator that holds a chosen
number of chat requests in flight through them.  Everything listens and connects on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections import Counter
from pathlib import Path

import httpx

from m3stack.local.processes import ProcessGroup, free_port
from tests.helpers.serving import TEST_HEALTH_ARGS

LOOPBACK = "127.0.0.1"
ENGINE_READY_TIMEOUT_S = 300.0
GATEWAY_READY_TIMEOUT_S = 120.0


class LoopbackStack:
    """``m3stack engine`` and ``m3stack gateway`` processes on 127.0.0.1, stopped together."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.processes = ProcessGroup(log_dir)
        self._names = itertools.count()

    def engine(self) -> str:
        """Starts a tiny CPU engine (few sequences at once, so requests also queue) and returns its address."""
        port, metrics_port = free_port(LOOPBACK), free_port(LOOPBACK)
        child = self.processes.start(
            f"engine-{next(self._names)}",
            [
                "engine", "--model", str(self.model_dir), "--device", "cpu", "--cpu-threads", "1",
                "--host", LOOPBACK, "--port", str(port), "--metrics-port", str(metrics_port),
                "--max-model-len", "256", "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--drain-timeout", "1",
            ],
        )  # fmt: skip
        self.processes.wait_http_ok(child, f"http://{LOOPBACK}:{metrics_port}/loaded", ENGINE_READY_TIMEOUT_S)
        return f"{LOOPBACK}:{port}"

    def gateways(self, engine_sets: list[list[str]]) -> list[str]:
        """Starts one gateway per set of engine addresses, all at once, and returns their base URLs once
        each is ready: taking requests, or, when none of its engines listens, refusing them with 503."""
        started = []
        for engines in engine_sets:
            port = free_port(LOOPBACK)
            child = self.processes.start(
                f"gateway-{next(self._names)}",
                [
                    "gateway", "--model", str(self.model_dir), "--host", LOOPBACK, "--port", str(port),
                    "--engines", ",".join(engines), *TEST_HEALTH_ARGS,
                    "--media-workers", "0",  # text only: no preprocessing processes to start
                ],
            )  # fmt: skip
            started.append((child, f"http://{LOOPBACK}:{port}", all(map(_listens, engines))))
        for child, base_url, engines_listen in started:
            path = "/ready" if engines_listen else "/health"
            self.processes.wait_http_ok(child, f"{base_url}{path}", GATEWAY_READY_TIMEOUT_S)
        return [base_url for _, base_url, _ in started]

    def stop(self) -> None:
        self.processes.stop_all(timeout_s=20)


def _listens(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) == 0


def unused_address() -> str:
    """A loopback HOST:PORT nothing listens on: an engine that is never there."""
    return f"{LOOPBACK}:{free_port(LOOPBACK)}"


class LoadGenerator:
    """Keeps ``level`` chat completions in flight, round-robin over the gateways, from its own event
    loop in a thread; lowering the level cancels requests (the gateway then aborts them)."""

    def __init__(self, gateways: list[str], model: str, max_tokens: int = 96) -> None:
        self.gateways = gateways
        self.model = model
        self.max_tokens = max_tokens
        self.outcomes: Counter[str] = Counter()  # "200", "503", "error: ..."
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="load", daemon=True)
        self._workers: list[asyncio.Task[None]] = []
        self._next_gateway = itertools.cycle(gateways)
        self._client: httpx.AsyncClient | None = None

    def __enter__(self) -> LoadGenerator:
        self._thread.start()
        self._call(self._open())
        return self

    def __exit__(self, *_: object) -> None:
        self.set_level(0)
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def set_level(self, level: int) -> None:
        self._call(self._resize(level))

    def _call(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _open(self) -> None:
        self._client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256), trust_env=False)

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _resize(self, level: int) -> None:
        while len(self._workers) < level:
            self._workers.append(asyncio.create_task(self._work(next(self._next_gateway))))
        while len(self._workers) > level:
            worker = self._workers.pop()
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    async def _work(self, gateway: str) -> None:
        assert self._client is not None
        request = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }
        while True:
            try:
                response = await self._client.post(f"{gateway}/v1/chat/completions", json=request)
                self.outcomes[str(response.status_code)] += 1
                if response.status_code != 200:
                    await asyncio.sleep(0.2)
            except httpx.HTTPError as error:
                self.outcomes[f"error: {type(error).__name__}"] += 1
                await asyncio.sleep(0.2)
