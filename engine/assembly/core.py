"""Assemble an ``EngineCore`` from an ``EngineConfig`` and a loaded model: size and allocate the KV cache, pick the
attention backend, capture decode CUDA graphs: ``assemble_engine_core``, for a model already loaded (one GPU's, or
a parallel engine's rank 0 with its ``RankZero`` parts).

KV sizing on cuda profiles one full step first (``max_num_batched_tokens`` tokens spread over
``max_num_seqs`` requests, through the real scheduler, runner and sampler, on a temporary cache) and
gives the KV cache what is left of ``gpu_memory_utilization`` of the device after weights and that
peak.  On cpu it takes ``kv_cache_gb`` (1 GiB by default).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from m3stack.engine import kernel_compiles
from m3stack.engine.assembly.choices import (
    CPU_DEFAULT_KV_GB,
    kv_cache_spec,
    make_attention_backend,
)
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.offload import OffloadSettings, build_offload, offload_tier_sizes
from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.kv_cache.interfaces import KVManager
from m3stack.engine.kv_cache.manager import KVCacheManager
from m3stack.engine.kv_cache.tensors import KVCacheSpec, allocate_kv_cache
from m3stack.engine.model.config import M3Config
from m3stack.engine.model.model import M3ForServing
from m3stack.engine.msa.metrics import MsaMonitor
from m3stack.engine.offload.layout import TierSizes
from m3stack.engine.runtime.cuda_graphs import DecodeGraphs, GraphPeers
from m3stack.engine.runtime.encoder_cache import EncoderCache
from m3stack.engine.runtime.engine_core import EngineCore
from m3stack.engine.runtime.grammar import GrammarCompiler
from m3stack.engine.runtime.model_info import ModelInfo
from m3stack.engine.runtime.request import Request, SamplingParams
from m3stack.engine.runtime.runner import ModelRunner
from m3stack.engine.runtime.scheduler import Scheduler, SchedulerConfig
from m3stack.engine.runtime.warmup import warm_up

logger = logging.getLogger(__name__)

DEFAULT_ENCODER_CACHE_EMBEDS = 16384


@dataclass(frozen=True)
class RankZero:
    """A parallel engine's first rank: its model sends each call to the workers before running its own shard."""

    backend_wrapper: Callable[[AttentionBackend], AttentionBackend]  # records each step's metadata for the workers
    shard: M3ForServing  # this rank's own model: what its decode graphs capture (messages cannot be captured)
    graph_peers: GraphPeers  # the workers, which capture and replay their graphs in step


def assemble_engine_core(
    config: EngineConfig,
    model: M3ForServing,
    m3: M3Config,
    *,
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    rank_zero: RankZero | None = None,
) -> EngineCore:
    """Size and allocate the KV cache for a loaded model, then build the scheduler, runner and core around it.

    ``rank_zero``: what a parallel engine's first rank assembles differently (``engine.distributed``).
    """
    parts = _Parts(config, model, m3, model_path, device, dtype, rank_zero)
    num_blocks = _num_kv_blocks(config, parts.spec, device, parts)
    block_size = parts.spec.block_size
    capacity = (num_blocks - 1) * block_size
    tiers = None
    if config.kv_offload_gb:
        tiers = offload_tier_sizes(parts.offload_settings, parts.spec, num_blocks)
        num_blocks = tiers.num_device
        capacity = (tiers.num_device - 1 + tiers.num_host) * block_size
    limit = m3.text.max_position_embeddings
    max_model_len = config.max_model_len or min(limit, capacity)
    if max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    if max_model_len > capacity:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the KV cache capacity of {capacity} tokens "
            f"({num_blocks - 1} blocks of {block_size}); lower it or give the KV cache more memory"
        )
    if device.type == "cuda":
        kernel_compiles.watch()  # a kernel compiled mid-serving stalls the batch: count and log them
    use_graphs = config.cuda_graphs and device.type == "cuda"
    core = parts.core(num_blocks, max_model_len, use_graphs, tiers)
    if use_graphs:
        core.runner.decode_graphs.capture()
    warmup = config.warmup if config.warmup is not None else device.type == "cuda"
    if warmup:  # before the engine reports itself loaded: the first users do not wait for kernel compiles
        warm_up(core, seed=config.seed)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); context limit %d",
        num_blocks - 1,
        block_size,
        capacity,
        num_blocks * parts.spec.bytes_per_page / 2**30,
        max_model_len,
    )
    return core


class _Parts:
    """Builds an ``EngineCore`` for a given KV size (the real one, or a small one to profile a step)."""

    def __init__(self, config: EngineConfig, model: M3ForServing, m3: M3Config, model_path: str,
                 device: torch.device, dtype: torch.dtype,
                 rank_zero: RankZero | None = None) -> None:  # fmt: skip
        self.rank_zero = rank_zero
        self.config = config
        self.model = model
        self.m3 = m3
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.spec = kv_cache_spec(config, model.kv_cache_spec(dtype))
        self.offload_settings = OffloadSettings(
            config.kv_offload_gb, config.kv_offload_hot_blocks, exact_device_blocks=config.num_kv_blocks is not None
        )

    def core(
        self, num_blocks: int, max_model_len: int, cuda_graphs: bool, tiers: TierSizes | None = None
    ) -> EngineCore:
        """With ``tiers``, ``num_blocks`` device blocks and CPU KV offload (``engine.offload``)."""
        config, block_size = self.config, self.spec.block_size
        offload = None
        kv_manager: KVManager
        if tiers is not None:
            offload = build_offload(self.offload_settings, self.spec, self.m3.text, tiers, device=self.device,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    max_num_seqs=config.max_num_seqs)  # fmt: skip
            kv_caches = offload.device.cache.layers
            kv_manager = offload.manager
        else:
            kv_caches = allocate_kv_cache(self.spec, num_blocks, self.device)
            kv_manager = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        device_offload = offload.device if offload is not None else None
        msa = self._msa_monitor()
        backend = make_attention_backend(kv_caches, self.m3, self.device, mode=config.attention, offload=device_offload,
                                         shared_page_scan=config.msa_shared_page_scan, monitor=msa)  # fmt: skip
        if self.rank_zero is not None:
            backend = self.rank_zero.backend_wrapper(backend)
        info = _model_info(config, self.model_path, self.m3, max_model_len, block_size, num_blocks, self.dtype,
                           self.device)  # fmt: skip
        encoder_cache = EncoderCache(
            config.encoder_cache_embeds or max(config.max_num_batched_tokens, DEFAULT_ENCODER_CACHE_EMBEDS)
        )
        scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_waiting=config.max_queue,
                max_encoder_embeds_per_step=config.max_num_batched_tokens,
            ),
            kv_manager,
            encoder_cache,
        )
        graphs = None
        if cuda_graphs:
            shard, peers = (self.rank_zero.shard, self.rank_zero.graph_peers) if self.rank_zero else (self.model, None)
            graphs = DecodeGraphs(shard, backend, self.device, block_size=block_size, max_batch=config.max_num_seqs,
                                  max_model_len=max_model_len, peers=peers)  # fmt: skip
        runner = ModelRunner(self.model, backend, encoder_cache, block_size=block_size,
                             vocab_size=self.m3.text.vocab_size, device=self.device, dtype=self.dtype,
                             decode_graphs=graphs, offload=device_offload, msa=msa,
                             max_num_seqs=config.max_num_seqs)  # fmt: skip
        async_scheduling = config.async_scheduling
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda"
        grammars = GrammarCompiler(Path(self.model_path) / "tokenizer.json", info.vocab_size, info.eos_token_ids)
        return EngineCore(info, scheduler, runner, async_scheduling=async_scheduling, offload=device_offload,
                          msa=msa, grammars=grammars)  # fmt: skip

    def _msa_monitor(self) -> MsaMonitor | None:
        """The MSA layers' counters, when the cache has MSA layers (none with ``--attention dense``)."""
        num_msa_layers = sum(self.spec.sparse_layers)
        if not num_msa_layers:
            return None
        text = self.m3.text
        return MsaMonitor(num_msa_layers=num_msa_layers, block_size=self.spec.block_size,
                          topk_blocks=text.index_topk_blocks, device=self.device)  # fmt: skip


def _num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device, parts: _Parts) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + 1  # plus the reserved null block
    if config.kv_cache_gb is not None or device.type != "cuda":
        budget = (config.kv_cache_gb or CPU_DEFAULT_KV_GB) * 2**30
    else:
        peak = _profile_step_bytes(config, spec, parts)
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) - peak
        logger.info(
            "memory: %.1f GiB in use, step peak %.2f GiB, %.1f GiB for the KV cache",
            (total - free) / 2**30,
            peak / 2**30,
            budget / 2**30,
        )
    num_blocks = int(budget // spec.bytes_per_page)
    if num_blocks < 2:
        raise ValueError(f"no room for a KV cache: {budget / 2**30:.2f} GiB gives {num_blocks} blocks")
    return num_blocks


def _profile_step_bytes(config: EngineConfig, spec: KVCacheSpec, parts: _Parts) -> int:
    """Peak device bytes one full step allocates beyond the weights (activations, logits, sampling)."""
    tokens = config.max_num_batched_tokens
    num_requests = min(config.max_num_seqs, tokens)
    per_request = tokens // num_requests
    blocks = num_requests * -(-per_request // spec.block_size) + 1
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    core = parts.core(blocks, per_request + 1, False)
    cache_bytes = torch.cuda.memory_allocated() - before
    for index in range(num_requests):
        core.add_request(
            Request(f"profile-{index}", [0] * per_request, SamplingParams(temperature=1.0, top_p=0.9), max_tokens=1)
        )
    while core.has_work:  # with async scheduling the first call only launches the step
        core.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - cache_bytes
    del core
    torch.cuda.empty_cache()
    return int(peak)


def _model_info(
    config: EngineConfig,
    model_path: str,
    m3: M3Config,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
) -> ModelInfo:
    return ModelInfo(
        model_path=model_path,
        served_model_name=config.served_model_name or Path(model_path).name,
        model_type="minimax_m3_vl",
        vocab_size=m3.text.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=m3.eos_token_ids,
        bos_token_id=m3.bos_token_id,
        block_size=block_size,
        image_token_id=m3.image_token_id,
        video_token_id=m3.video_token_id,
        patch_dim=m3.vision.patch_dim,
        spatial_merge_size=m3.vision.spatial_merge_size,
        supports_vision=True,
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        num_kv_blocks=num_blocks - 1,  # usable ones: the null block is never handed out
    )
