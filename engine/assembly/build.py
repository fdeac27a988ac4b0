"""Build an engine core from its configuration: the one entry of ``engine.assembly``, one rank or many."""

import logging

import torch

from m3stack.engine.assembly.choices import resolve_device, resolve_dtype
from m3stack.engine.assembly.config import EngineConfig, model_folder
from m3stack.engine.assembly.core import assemble_engine_core
from m3stack.engine.assembly.sizing import check_before_loading
from m3stack.engine.model.loader import load_model
from m3stack.engine.runtime.engine_core import EngineCore

logger = logging.getLogger(__name__)


def build_engine_core(config: EngineConfig) -> EngineCore:
    """Load ``config.model`` and assemble the engine around it."""
    if config.parallel.is_parallel:  # one process per GPU: engine.distributed starts them and shards the model
        from m3stack.engine.assembly.parallel import build_parallel_engine_core  # torch.distributed: only then

        return build_parallel_engine_core(config)
    device = resolve_device(config.device)
    check_before_loading(config, device)
    dtype = resolve_dtype(config.dtype, device)
    folder = model_folder(config.model)
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    torch.manual_seed(config.seed)
    logger.info("loading %s on %s (%s)", folder, device, str(dtype).removeprefix("torch."))
    model, m3 = load_model(folder, device, dtype)
    return assemble_engine_core(config, model, m3, model_path=str(folder), device=device, dtype=dtype)
