"""Before loading: does the checkpoint fit the engine's GPUs?  ``m3stack.sizing``'s figures for an ``EngineConfig``,
from config.json and the safetensors headers alone (no torch), so the engine and ``m3stack up`` refuse a
deployment that cannot hold its model with the figures instead of failing on an out-of-memory error minutes into
loading.  The KV cache is then sized for real after loading (``core``); this check only needs the estimate.
"""

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from m3stack.engine.assembly.config import EngineConfig, model_folder
from m3stack.engine.model.config import load_config
from m3stack.engine.model.sizing import checkpoint_weights, model_shape
from m3stack.sizing import GIB, MXFP8_SCRATCH_BYTES, Deployment, Sizing, SizingError, exact_blocks_bytes, size

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bytes a value of the serving dtype takes: --dtype auto serves bfloat16 on GPUs.
SERVING_BYTES = {"auto": 2, "bfloat16": 2, "float32": 4}


def engine_sizing(config: EngineConfig, gpu_memory_bytes: int) -> Sizing:
    """The figures of ``config``'s checkpoint on its GPUs (``config.parallel.tensor_parallel`` of them)."""
    folder = model_folder(config.model)
    m3 = load_config(folder)
    serving_bytes = SERVING_BYTES[config.dtype]
    shape = model_shape(m3.text)
    if config.attention == "dense":  # no index keys cached
        shape = replace(shape, sparse_layers=0)
    deployment = Deployment(
        gpus=config.parallel.tensor_parallel,
        gpu_memory_bytes=gpu_memory_bytes,
        memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        activation_bytes=serving_bytes,
        kv_bytes=1 if config.kv_cache_dtype == "fp8_e4m3" else serving_bytes,
        fp8_index=config.index_dtype == "fp8_e4m3",
        cpu_offload_bytes=int(config.kv_offload_gb * GIB),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        scratch_bytes=MXFP8_SCRATCH_BYTES if m3.quantization is not None else 0,
        kv_cache_bytes=None if config.kv_cache_gb is None else int(config.kv_cache_gb * GIB),
    )
    if config.num_kv_blocks is not None:  # an exact block count (tests, benchmarks): its bytes, the null block's too
        deployment = replace(deployment, kv_cache_bytes=exact_blocks_bytes(shape, deployment, config.num_kv_blocks))
    return size(checkpoint_weights(folder, m3, serving_bytes), shape, deployment)


def check_fits(config: EngineConfig, gpu_memory_bytes: int) -> Sizing:
    """``engine_sizing``, or a ``SizingError`` naming the figures when the checkpoint does not fit."""
    sizing = engine_sizing(config, gpu_memory_bytes)
    if not sizing.fits:
        raise SizingError(
            f"{config.model} does not fit --tensor-parallel {config.parallel.tensor_parallel}: {sizing.summary()}. "
            "Give it more GPUs (--tensor-parallel), an MXFP8 checkpoint, a shorter --max-model-len, an fp8 KV cache "
            "(--kv-cache-dtype fp8_e4m3) or CPU KV offload (--kv-offload-gb)"
        )
    logger.info("sizing: %s", sizing.summary())
    return sizing


def check_before_loading(config: EngineConfig, device: "torch.device") -> None:
    """``check_fits`` against ``--device-memory-gb``, else ``device``'s memory; on cpu only with the flag."""
    if config.device_memory_gb is not None:
        check_fits(config, int(config.device_memory_gb * GIB))
    elif device.type == "cuda":
        import torch  # loaded already in an engine; ``m3stack up`` imports this module without it

        check_fits(config, torch.cuda.get_device_properties(device).total_memory)
