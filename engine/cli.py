"""Run one inference engine: load a model, serve engine.proto over gRPC, metrics and probes over HTTP.

Logs one line starting with "m3stack engine ready" once it serves; GET /loaded on the metrics port
answers 200 from then on.  SIGTERM (or Ctrl-C) drains: new requests get UNAVAILABLE, running ones
finish within --drain-timeout, the rest end with finish reason ABORT.
"""

import argparse
import logging
from typing import TYPE_CHECKING

from m3stack import options
from m3stack.options import OptionGroup

if TYPE_CHECKING:  # imported when the engine runs, not for `m3stack --help`
    from m3stack.engine.assembly.config import EngineConfig
    from m3stack.engine.distributed.config import ParallelConfig

logger = logging.getLogger(__name__)


def add_arguments(opts: OptionGroup) -> None:
    opts.add(
        "--model", default="default", help="HF-layout M3 checkpoint folder, or 'default' for the embedded tiny model"
    )
    opts.add("--served-model-name", default="", help="name reported by GetModelInfo (default: the folder name)")
    opts.add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    opts.add(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="weights and KV cache dtype; auto = bfloat16 on cuda, float32 on cpu",
    )
    opts.add("--host", default="127.0.0.1", help="gRPC listen address")
    opts.add("--port", type=options.port, default=50051, help="gRPC port")
    opts.add("--metrics-host", default="", help="HTTP listen address for /metrics and probes (default: --host)")
    opts.add("--metrics-port", type=options.port, default=9400, help="HTTP port for /metrics, /loaded, /ready, /health")
    opts.add("--max-num-seqs", type=options.positive_int, default=64, help="requests running at once")
    opts.add(
        "--max-num-batched-tokens",
        type=options.positive_int,
        default=4096,
        help="token budget of one engine step (decodes plus prefill chunks)",
    )
    opts.add(
        "--max-model-len",
        type=options.positive_int,
        default=None,
        help="context limit per request, prompt plus output (default: the model's, capped by KV capacity)",
    )
    opts.add(
        "--kv-cache-gb",
        type=options.positive_float,
        default=None,
        help="KV cache size in GiB (default: --gpu-memory-utilization on cuda, 1 GiB on cpu)",
    )
    opts.add(
        "--kv-offload-gb",
        type=options.non_negative_float,
        default=0.0,
        help="pinned host memory for KV blocks moved off the GPU under pressure (0: off); MSA layers' K/V go there, "
        "the k-index and dense layers stay on the GPU, decode steps copy the selected blocks back on demand; "
        "for the whole engine: with --tensor-parallel N each rank holds 1/N of it (its heads' share)",
    )
    opts.add(
        "--kv-offload-hot-blocks",
        type=options.positive_int,
        default=None,
        help="GPU pages per request with offloaded blocks that cache them between decode steps "
        "(default: what one decode token can select, index heads x ranked blocks)",
    )
    opts.add(
        "--gpu-memory-utilization",
        type=options.fraction,
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV cache when --kv-cache-gb is unset",
    )
    opts.add(
        "--device-memory-gb",
        type=options.positive_float,
        default=None,
        help="memory of one device in GiB for the check before loading that the model fits (default: the GPU's "
        "own on cuda; no check on cpu)",
    )
    opts.add(
        "--max-queue",
        type=options.positive_int,
        default=1024,
        help="waiting requests before new ones get RESOURCE_EXHAUSTED",
    )
    opts.add(
        "--drain-timeout",
        type=options.non_negative_float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    opts.add(
        "--max-message-mb",
        type=options.positive_int,
        default=256,
        help="largest gRPC message accepted, in MiB (inline image/video tensors must fit)",
    )
    opts.add("--seed", type=options.non_negative_int, default=0, help="seed of unseeded sampling")
    opts.add(
        "--cpu-threads",
        type=options.positive_int,
        default=None,
        help="torch intra-op threads (default: torch's choice; 1 is fastest for the tiny model on a busy host)",
    )
    opts.flag("--disable-prefix-caching", help="never share KV blocks between requests")
    opts.flag("--enforce-eager", help="no CUDA graphs for decode steps")
    opts.flag("--skip-warmup", help="take traffic without first compiling the kernels on synthetic requests (GPU)")
    opts.add(
        "--attention",
        default="auto",
        choices=["auto", "msa", "dense", "naive"],
        help="attention path: msa = Triton MSA kernels + FlashInfer (auto on cuda); dense = every layer as full "
        "attention on the same backend (a baseline); naive = the plain-PyTorch reference, gather + query-major "
        "(auto on cpu)",
    )
    opts.flag(
        "--msa-shared-page-scan",
        help="MSA decode: score the pages several requests share (one prompt prefix) once for them in the index scan",
    )
    opts.add(
        "--index-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],  # kv_cache.tensors.INDEX_DTYPES
        help="MSA k-index storage: auto = as --dtype; fp8_e4m3 = 8-bit keys with a float32 scale per token (half "
        "the bytes the decode index scan reads)",
    )
    opts.add(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],  # kv_cache.tensors.KV_CACHE_DTYPES
        help="K/V cache storage: auto = as --dtype; fp8_e4m3 = 8-bit K and V (half a bf16 cache's bytes, so twice the "
        "tokens; attention runs in Triton, FlashInfer reads half-precision caches only)",
    )
    opts.add(
        "--tensor-parallel",
        type=options.positive_int,
        default=1,
        help="GPUs one engine spans (one process each; on several nodes with --nnodes): attention heads, MLP rows, "
        "experts and vocabulary split across them",
    )
    opts.flag("--expert-parallel", help="MoE layers: whole experts per GPU instead of a slice of every expert")
    opts.add("--nnodes", type=options.positive_int, default=1, help="nodes of a multi-node engine (LeaderWorkerSet)")
    opts.add(
        "--node-rank",
        type=options.non_negative_int,
        default=0,
        help="this node's index: 0 runs the scheduler and gRPC server, the others only serve their GPUs' ranks",
    )
    opts.add("--master-addr", default="127.0.0.1", help="address of node 0, where every rank meets")
    opts.add(
        "--master-port",
        type=options.non_negative_int,
        default=0,
        help="rendezvous port on node 0 (0: a free port, one node only)",
    )
    opts.flag(
        "--disable-async-scheduling",
        help="finish each step before scheduling the next (by default on cuda the host overlaps the GPU)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from m3stack.engine.assembly.config import model_folder

    try:
        parallel = parallel_config(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.model != "default":  # fail fast, before the seconds torch takes to import
        try:
            model_folder(args.model)
        except ValueError as exc:
            logger.error("%s", exc)
            return 1
    from m3stack.engine.server.grpc_server import GrpcSettings
    from m3stack.engine.server.serve import ServeSettings, serve

    settings = ServeSettings(
        engine=engine_config(args, parallel),
        grpc=GrpcSettings(host=args.host, port=args.port, max_message_bytes=args.max_message_mb * 2**20),
        metrics_host=args.metrics_host or args.host,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
    )
    if parallel.node_rank > 0:  # a worker node of a multi-node engine: no server, only this node's ranks
        from m3stack.engine.assembly.parallel import run_worker_node

        return run_worker_node(settings.engine)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        return 130


def parallel_config(args: argparse.Namespace) -> "ParallelConfig":
    """The parallelism the flags ask for (a ``ValueError`` names a bad combination)."""
    from m3stack.engine.distributed.config import ParallelConfig

    return ParallelConfig(
        tensor_parallel=args.tensor_parallel,
        expert_parallel=args.expert_parallel,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )


def engine_config(args: argparse.Namespace, parallel: "ParallelConfig") -> "EngineConfig":
    """The ``EngineConfig`` the flags (and their ``M3STACK_ENGINE_*`` variables) ask for; ``m3stack up`` sizes
    its engines from the same."""
    from m3stack.engine.assembly.config import EngineConfig

    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device_memory_gb=args.device_memory_gb,
        max_queue=args.max_queue,
        enable_prefix_caching=not args.disable_prefix_caching,
        cuda_graphs=not args.enforce_eager,
        warmup=False if args.skip_warmup else None,
        async_scheduling=False if args.disable_async_scheduling else None,
        cpu_threads=args.cpu_threads,
        attention=args.attention,
        msa_shared_page_scan=args.msa_shared_page_scan,
        index_dtype=args.index_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_offload_gb=args.kv_offload_gb,
        kv_offload_hot_blocks=args.kv_offload_hot_blocks,
        seed=args.seed,
        parallel=parallel,
    )
