"""The engines under test: the benchmark model (and, for a config that serves MXFP8 weights, its MXFP8 copy), the
``EngineCore`` of each config (``state.CONFIGS``), and an ``EngineCore`` served by the real gRPC server on loopback.
torch and the engine are imported where they are used, as in the whole package: the clients' process must not
import them, and the budget clock starts before torch's import (``bench.serving.cli.run``)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import time
from typing import TYPE_CHECKING, Any

import grpc

from bench.serving.state import CONFIGS, Bench
from m3stack.gateway.engine_client.client import CHANNEL_OPTIONS
from m3stack.proto import engine_pb2_grpc

if TYPE_CHECKING:
    import torch

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

        model, m3 = build_model(args.layers, args.moe, device)
        dtype, name = torch.bfloat16, f"random-m3-dims-{args.layers}-layers" + ("-moe" if args.moe else "")
    if max_len > m3.text.max_position_embeddings:  # RoPE angles are computed per step: no table to outgrow
        m3 = dataclasses.replace(m3, text=dataclasses.replace(m3.text, max_position_embeddings=max_len))
    return model, m3, dtype, name


def mxfp8_copy(model: M3ForServing, m3: M3Config, device: torch.device, dtype: torch.dtype
               ) -> tuple[M3ForServing, M3Config]:  # fmt: skip
    """``model`` in the MiniMax-M3-MXFP8 release's format, as the engine loads that release: the linears its writer
    quantizes (``mxfp8_writer``: every ``weights.quantizable`` one that ``RELEASE_IGNORED_LAYERS`` leaves) hold
    ``mxfp8.quantize``'s FP8 values and E8M0 scales, kept FP8 on ``device`` in the model the loader builds for such a
    checkpoint (``M3ForServing(quantized=...)``); every other parameter is ``model``'s.  Built in memory: writing
    and reading back a checkpoint at M3's dims would spend minutes of the budget.  A test holds it equal, tensor for
    tensor, to the loader's model of the writer's copy of the same checkpoint."""
    import torch

    from m3stack.engine.model import mxfp8
    from m3stack.engine.model.model import M3ForServing
    from m3stack.engine.model.mxfp8_writer import RELEASE_IGNORED_LAYERS
    from m3stack.engine.model.quantization import Mxfp8Config, scale_name
    from m3stack.engine.model.weights import checkpoint_tensors, quantizable

    quantization = Mxfp8Config(ignored_layers=RELEASE_IGNORED_LAYERS)
    m3 = dataclasses.replace(m3, quantization=quantization)
    quantized = {spec.param for spec in checkpoint_tensors(m3)
                 if quantizable(spec.param) and not quantization.ignores(spec.name)}  # fmt: skip
    copy = M3ForServing(m3, dtype, device, quantized=quantized)
    params = dict(copy.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name in quantized:
                values, scales = mxfp8.quantize(tensor)
                params[name].copy_(values)
                params[scale_name(name)].copy_(scales)  # into the block-major storage, as the loader copies
            else:
                params[name].copy_(tensor)
    return copy.eval(), m3


def served_weights(model: M3ForServing) -> dict[str, Any]:
    """What an engine's model holds: parameter bytes by dtype, and how many parameters are MXFP8 (FP8 values with
    E8M0 scales beside them)."""
    from m3stack.engine.model import mxfp8

    by_dtype: collections.Counter[str] = collections.Counter()
    for param in model.parameters():
        by_dtype[str(param.dtype).removeprefix("torch.")] += param.numel() * param.element_size()
    return {"parameter_bytes": dict(by_dtype),
            "mxfp8_parameters": sum(mxfp8.is_quantized(param) for param in model.parameters())}  # fmt: skip


def build_core(bench: Bench, name: str, config: EngineConfig) -> EngineCore:
    """Config ``name``'s engine: ``bench.model``, or for an MXFP8 config its copy (freed with the engine)."""
    from m3stack.engine.assembly.core import assemble_engine_core

    model, m3 = bench.model, bench.m3
    if CONFIGS[name].mxfp8_weights:
        model, m3 = mxfp8_copy(model, m3, bench.device, bench.dtype)
    core = assemble_engine_core(config, model, m3, model_path=bench.extra["model"], device=bench.device,
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
