"""Build a parallel engine: each rank's shard, a KV cache size every rank agrees on, rank 0's ``EngineCore``.

One process per GPU (``engine.distributed.processes`` starts and watches them).  On the leader node,
``build_parallel_engine_core`` (called by ``build.build_engine_core`` when ``--tensor-parallel`` > 1) spawns the
node's other ranks, becomes rank 0 and returns the ``EngineCore`` the server drives.  On the other nodes of a
multi-node engine (LeaderWorkerSet workers), ``run_worker_node`` spawns that node's ranks and serves as its first
one.  Every rank then does the same, in the same order, so their collectives meet: join the groups, build and load
its shard, size the KV cache (the minimum over ranks wins), allocate it.  Workers then loop in
``worker.serve_steps``; rank 0 stops them at exit.

A rank that ends unasked ends its node's engine process (``processes.RankWatch``).
"""

import atexit
import logging
import multiprocessing.process
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from m3stack.engine import kernel_compiles
from m3stack.engine.assembly.choices import (
    CPU_DEFAULT_KV_GB,
    kv_cache_spec,
    make_attention_backend,
    resolve_device,
    resolve_dtype,
)
from m3stack.engine.assembly.config import EngineConfig, model_folder
from m3stack.engine.assembly.core import RankZero, assemble_engine_core
from m3stack.engine.assembly.offload import OffloadSettings, build_offload, offload_tier_sizes
from m3stack.engine.assembly.sizing import check_before_loading
from m3stack.engine.distributed.channel import Channel, LostRankError
from m3stack.engine.distributed.leader import LeaderModel
from m3stack.engine.distributed.model import ShardedM3, load_sharded_model
from m3stack.engine.distributed.processes import (
    LOST_RANK_EXIT_CODE,
    STOP_JOIN_SECONDS,
    RankWatch,
    disable_multicast,
    free_port,
    init_spawned_rank,
    join_process_groups,
    leave_process_group,
    rank_device,
    spawn_ranks,
)
from m3stack.engine.distributed.sharding import plan_shards
from m3stack.engine.distributed.worker import serve_steps
from m3stack.engine.kv_cache.tensors import allocate_kv_cache
from m3stack.engine.model.config import load_config
from m3stack.engine.offload.layout import tier_sizes
from m3stack.engine.runtime.engine_core import EngineCore

logger = logging.getLogger(__name__)

# Float32 copies of the sampled rows' logits the sampler may hold at once (rank 0's profile headroom).
SAMPLER_LOGIT_COPIES = 3


@dataclass
class RankState:
    """What one rank built: its shard, where it runs, the groups, the agreed KV block count (null block included)."""

    model: ShardedM3
    device: torch.device
    dtype: torch.dtype
    channel: Channel
    num_blocks: int


def start_rank(config: EngineConfig, rank: int, local_rank: int, collectives: str | None = None) -> RankState:
    """Join the groups, build and load this rank's shard, agree on the KV cache size.

    ``collectives``: the default group's backend (``processes.join_process_groups``).
    """
    parallel = config.parallel
    device = rank_device(config.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kernel_compiles.watch()
    dtype = resolve_dtype(config.dtype, device)
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    folder = model_folder(config.model)
    # Fail on a model that cannot be split before joining: every rank finds the same error.
    plan = plan_shards(load_config(folder).text, parallel.tensor_parallel, rank, parallel.expert_parallel)
    channel = join_process_groups(parallel, rank, device, collectives)
    model, _ = load_sharded_model(folder, plan, device, dtype)
    num_blocks = _agree_num_blocks(config, model, device, dtype, channel)
    return RankState(model, device, dtype, channel, num_blocks)


def rank_offload_gb(config: EngineConfig) -> float:
    """A rank's share of ``--kv-offload-gb``, which is the whole engine's: each rank holds its heads' K/V, so a
    parallel engine keeps as many host blocks as one GPU's with the same setting, in the same pinned memory."""
    return config.kv_offload_gb / config.parallel.tensor_parallel


def _agree_num_blocks(
    config: EngineConfig, model: ShardedM3, device: torch.device, dtype: torch.dtype, channel: Channel
) -> int:
    spec = kv_cache_spec(config, model.kv_cache_spec(dtype))
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks + 1
    elif config.kv_cache_gb is not None or device.type != "cuda":
        blocks = int((config.kv_cache_gb or CPU_DEFAULT_KV_GB) * 2**30 // spec.bytes_per_page)
    else:
        peak = _profile_peak_bytes(config, model, device, dtype)
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) - peak
        logger.info(
            "rank %d: step peak %.2f GiB, %.1f GiB for the KV cache", dist.get_rank(), peak / 2**30, budget / 2**30
        )
        blocks = int(budget // spec.bytes_per_page)
    if config.kv_offload_gb and config.num_kv_blocks is None:
        # Host blocks keep their index keys (and dense layers' K/V) on the device: their part comes out of the
        # budget first.  Every rank then sizes its tiers from the agreed count as given (``run_worker``).
        blocks = tier_sizes(spec, blocks * spec.bytes_per_page, rank_offload_gb(config) * 2**30).num_device
    agreed = torch.tensor([blocks], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=channel.control)
    if int(agreed) < 2:
        raise ValueError(f"no room for a KV cache on some rank: {int(agreed)} blocks")
    return int(agreed)


def _profile_peak_bytes(config: EngineConfig, model: ShardedM3, device: torch.device, dtype: torch.dtype) -> int:
    """Peak bytes of one full-budget prefill forward plus its logits, run on every rank at once."""
    from m3stack.engine.kv_cache.metadata import AttentionMetadata

    spec = kv_cache_spec(config, model.kv_cache_spec(dtype))
    tokens = config.max_num_batched_tokens
    sampled = min(config.max_num_seqs, tokens)
    pages = -(-tokens // spec.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    caches = allocate_kv_cache(spec, pages + 1, device)
    cache_bytes = torch.cuda.memory_allocated(device) - before
    backend = make_attention_backend(caches, model.local_config(), device, mode=config.attention,
                                     shared_page_scan=config.msa_shared_page_scan)  # fmt: skip
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    positions = torch.arange(tokens, device=device)
    metadata = AttentionMetadata(
        block_size=spec.block_size,
        query_start_loc=starts.to(device),
        seq_lens=lens.to(device),
        positions=positions,
        slot_mapping=positions + spec.block_size,
        page_table=torch.arange(1, pages + 1, dtype=torch.int32, device=device)[None],
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    with torch.inference_mode():
        backend.begin_step(metadata)
        hidden = model.forward(torch.zeros(tokens, dtype=torch.int64, device=device), positions, backend)
        model.compute_logits(hidden[-sampled:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    del caches, backend, hidden
    torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        peak += SAMPLER_LOGIT_COPIES * sampled * model.config.text.vocab_size * 4
    return int(peak)


def run_worker(config: EngineConfig, rank: int, local_rank: int) -> None:
    """One worker rank, to the end: build, then replay rank 0's calls until it says STOP."""
    if local_rank:
        init_spawned_rank()
    state = start_rank(config, rank, local_rank)
    spec = kv_cache_spec(config, state.model.kv_cache_spec(state.dtype))
    text = state.model.local_config().text
    offload = None
    if config.kv_offload_gb:  # this rank's heads on its own tiers, sized as rank 0 sizes its own
        settings = OffloadSettings(rank_offload_gb(config), config.kv_offload_hot_blocks, exact_device_blocks=True)
        offload = build_offload(settings, spec, text, offload_tier_sizes(settings, spec, state.num_blocks),
                                enable_prefix_caching=config.enable_prefix_caching, max_num_seqs=config.max_num_seqs,
                                device=state.device).device  # fmt: skip
        caches = offload.cache.layers
    else:
        caches = allocate_kv_cache(spec, state.num_blocks, state.device)
    backend = make_attention_backend(caches, state.model.local_config(), state.device, mode=config.attention,
                                     offload=offload, shared_page_scan=config.msa_shared_page_scan)  # fmt: skip
    try:
        serve_steps(state.model, backend, state.channel, offload)
    except LostRankError as exc:
        logger.critical("rank %d lost the engine's other ranks while waiting for a step (%s); exiting", rank, exc)
        raise SystemExit(LOST_RANK_EXIT_CODE) from None
    dist.destroy_process_group()


def run_worker_node(config: EngineConfig) -> int:
    """A non-leader node of a multi-node engine: its ranks run until the leader stops them (or dies)."""
    disable_multicast()
    processes = spawn_ranks(config.parallel, run_worker, config)
    watch = RankWatch(processes)
    try:
        run_worker(config, config.parallel.first_rank, 0)
    finally:
        watch.expect_exit()
        for process in processes:
            process.join(STOP_JOIN_SECONDS)
    return max((abs(p.exitcode or 0) for p in processes), default=0)


def build_parallel_engine_core(config: EngineConfig) -> EngineCore:
    """Rank 0 of a parallel engine (the leader node's first process); the other ranks start from here."""
    parallel = config.parallel
    if parallel.node_rank != 0:
        raise ValueError("only the leader node (--node-rank 0) builds the engine core")
    check_before_loading(config, resolve_device(config.device))  # before any rank starts loading its shard
    disable_multicast()
    if not parallel.master_port:
        config = replace(config, parallel=replace(parallel, master_port=free_port()))
    processes = spawn_ranks(config.parallel, run_worker, config)
    watch = RankWatch(processes)  # from the start: a rank failing to load would leave rank 0 waiting to meet it
    try:
        state = start_rank(config, 0, 0)
    except BaseException:
        watch.expect_exit()
        for process in processes:
            process.kill()
        raise
    leader = LeaderModel(state.model, state.channel)
    # The agreed block count replaces the builder's own sizing; rank 0 offloads its own share.
    engine_config = replace(config, num_kv_blocks=state.num_blocks - 1, kv_offload_gb=rank_offload_gb(config))
    core = assemble_engine_core(
        engine_config,
        leader,
        state.model.local_config(),
        model_path=str(model_folder(config.model)),  # type: ignore[arg-type]
        device=state.device,
        dtype=state.dtype,
        rank_zero=RankZero(backend_wrapper=leader.record, shard=state.model, graph_peers=leader),
    )
    stop = _Stopper(leader, processes, watch)
    _STOPPERS[id(core)] = stop
    atexit.register(stop)
    logger.info(
        "parallel engine: %d ranks (%s), %d KV blocks per rank",
        parallel.tensor_parallel,
        "expert-parallel MoE" if parallel.expert_parallel else "tensor-parallel MoE",
        state.num_blocks - 1,
    )
    return core


class _Stopper:
    """Stops a parallel engine's workers once (at interpreter exit, or earlier through ``stop_parallel_engine``)."""

    def __init__(
        self, leader: LeaderModel, processes: list[multiprocessing.process.BaseProcess], watch: RankWatch
    ) -> None:
        self.leader = leader
        self.processes = processes
        self.watch = watch
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.watch.expect_exit()
        try:
            self.leader.stop_workers()
        except Exception:
            logger.exception("could not tell the workers to stop")
        leave_process_group(STOP_JOIN_SECONDS)
        for process in self.processes:
            process.join(STOP_JOIN_SECONDS)
            if process.is_alive():
                process.kill()


_STOPPERS: dict[int, _Stopper] = {}


def stop_parallel_engine(core: EngineCore) -> None:
    """Stop the workers of a parallel engine built in this process and leave its process groups."""
    stop = _STOPPERS.pop(id(core), None)
    if stop is None:
        raise ValueError("this EngineCore is not a running parallel engine")
    atexit.unregister(stop)
    stop()
