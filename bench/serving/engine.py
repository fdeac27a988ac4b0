"""The engines under test: the benchmark model, the ``EngineCore`` of each config (``state.CONFIGS``), and an
``EngineCore`` served by the real gRPC server on loopback.  torch and the engine are imported where they are used,
as in the whole package: the clients' process must not import them, and the budget clock starts before torch's
import (``bench.serving.cli.run``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import time
from typing import TYPE_CHECKING

import grpc

from m3stack.gateway.engine_client.client import CHANNEL_OPTIONS
from m3stack.proto import engine_pb2_grpc

if TYPE_CHECKING:
    import torch

    from bench.serving.state import Bench
    from m3stack.engine.assembly.config import EngineConfig
    from m3stack.engine.model.config import M3Config
    from m3stack.engine.model.model import M3ForServing
    from m3stack.engine.runtime.engine_core import EngineCore, EngineStats

STATS_PERIOD_S = 0.26  # the offload copies its device counters to the host at most every 0.25 s (engine.offload)


def load_model(args: argparse.Namespace, device: torch.device, max_len: int
               ) -> tuple[M3ForServing, M3Config, torch.dtype, str]:  # fmt: skip
    """The benchmark model (``--model``) with a position limit of at least ``max_len``; its dtype and a name."""
    import torch

    if args.model == "tiny":
        from m3stack.engine.model.loader import load_model as load_checkpoint
        from m3stack.engine.model.tiny import ensure_tiny_checkpoint

        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model, m3 = load_checkpoint(ensure_tiny_checkpoint(), device, dtype)
        name = "tiny-random"
    else:
        from bench.engine_step import build_model

        model, m3 = build_model(args.layers, False, device)
        dtype, name = torch.bfloat16, f"random-m3-dims-{args.layers}-layers"
    if max_len > m3.text.max_position_embeddings:  # RoPE angles are computed per step: no table to outgrow
        m3 = dataclasses.replace(m3, text=dataclasses.replace(m3.text, max_position_embeddings=max_len))
    return model, m3, dtype, name


def build_core(bench: Bench, config: EngineConfig) -> EngineCore:
    from m3stack.engine.assembly.core import assemble_engine_core

    core = assemble_engine_core(config, bench.model, bench.m3, model_path=bench.extra["model"], device=bench.device,
                                dtype=bench.dtype)  # fmt: skip
    if core.offload is not None:
        core.offload.timing = True  # CUDA-event timing of the copies of eager steps (H2D GB/s)
    return core


def free_device_memory(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class ServedEngine:
    """An ``EngineCore`` behind the real gRPC server on a free loopback port, and a client channel to it."""

    def __init__(self, core: EngineCore) -> None:
        from m3stack.engine.server.async_engine import AsyncEngine
        from m3stack.engine.server.grpc_server import GrpcServer, GrpcSettings

        self.core = core
        self.engine = AsyncEngine(core)
        self.server = GrpcServer(self.engine, GrpcSettings(host="127.0.0.1", port=0))
        self.address = ""
        self.channel: grpc.aio.Channel | None = None
        self.stub: engine_pb2_grpc.EngineStub | None = None

    async def __aenter__(self) -> ServedEngine:
        self.engine.start()
        self.address = f"127.0.0.1:{await self.server.start()}"
        self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
        await self.server.stop(0.5)
        await self.engine.stop()

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds so far of (the event loop's thread: the gRPC server, this benchmark's awaits; the engine
        thread).  Call on the event loop's thread.  The clients run in their own process."""
        return time.thread_time(), self.engine.thread_cpu_seconds()

    async def stats(self) -> EngineStats:
        """Engine statistics with the offload's device counters up to date (they reach the host lazily)."""
        if self.core.offload is not None and self.core.runner.device.type == "cuda":
            await asyncio.sleep(STATS_PERIOD_S)  # then a read starts a copy of the counters, the next takes it
            await self.engine.run_on_engine_thread(lambda core: core.stats())
            await asyncio.sleep(0.01)
        return await self.engine.run_on_engine_thread(lambda core: core.stats())
