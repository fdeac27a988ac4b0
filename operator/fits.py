"""Whether an M3Deployment's engines can hold its model: the ``Fits`` condition (``status``), from the spec alone.

The operator never reads the checkpoint (it lies on a volume only the pods mount), so it knows the released M3
checkpoints by name (``m3stack.sizing.KNOWN_CHECKPOINTS``: ``model.path``'s or ``model.name``'s last part is
``MiniMax-M3`` or ``MiniMax-M3-MXFP8``) and GPUs by ``accelerator.product`` (``NVIDIA-H200``, ``NVIDIA-B200``).
With both known it sizes one engine (``parallelism.tensor`` GPUs; ``engine.maxModelLen`` and
``engine.gpuMemoryUtilization``, the KV dtypes and CPU offload from ``engine.kvCache``) as the engine will before
loading; otherwise the condition is Unknown and says what it lacks, and the engine's own check (which reads the
checkpoint) is the one that refuses.

A resource may still give the context and utilization as ``--max-model-len`` / ``--gpu-memory-utilization`` in
``engine.extraArgs`` (the only way before the fields existed): those are read where the field is unset.  Never
both: the CRD refuses a field together with its flag in extraArgs (``spec_schema``), so the value sized here is
the one the engine runs with.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from m3stack.operator.spec import Engine, M3Deployment
from m3stack.sizing import (
    DEFAULT_MEMORY_UTILIZATION,
    KNOWN_CHECKPOINTS,
    MXFP8_SCRATCH_BYTES,
    Deployment,
    gpu_memory,
    known_checkpoint,
    size,
)

FITS = "Fits"
MODEL_FITS = "ModelFits"
INSUFFICIENT_GPU_MEMORY = "InsufficientGPUMemory"
UNKNOWN_MODEL = "UnknownModel"
UNKNOWN_ACCELERATOR = "UnknownAccelerator"
CPU_ENGINES = "CPUEngines"
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Fit:
    status: str  # True, False, Unknown
    reason: str
    message: str


def assess_fit(m3d: M3Deployment) -> Fit:
    engine, model = m3d.spec.engine, m3d.spec.model
    if engine.accelerator.count == 0:
        return Fit("Unknown", CPU_ENGINES, "accelerator.count is 0: the engines run on CPU")
    known = known_checkpoint(model.path, model.name)
    if known is None:
        names = ", ".join(checkpoint.name for checkpoint in KNOWN_CHECKPOINTS)
        return Fit("Unknown", UNKNOWN_MODEL, f"model {model.path} is not a release the operator knows the size of "
                   f"({names}); the engine checks its checkpoint before loading")  # fmt: skip
    memory = gpu_memory(engine.accelerator.product) if engine.accelerator.product else None
    if memory is None:
        return Fit("Unknown", UNKNOWN_ACCELERATOR, f"accelerator.product {engine.accelerator.product or '(unset)'} is "
                   "not a GPU the operator knows the memory of (NVIDIA-H200, NVIDIA-B200, NVIDIA-H100)")  # fmt: skip
    deployment = Deployment(
        gpus=engine.tensor_parallel,
        gpu_memory_bytes=memory,
        memory_utilization=_setting(engine, engine.gpu_memory_utilization, "--gpu-memory-utilization", float)
        or DEFAULT_MEMORY_UTILIZATION,
        max_model_len=_setting(engine, engine.max_model_len, "--max-model-len", int),
        kv_bytes=1 if engine.kv_cache_dtype == "fp8_e4m3" else 2,
        fp8_index=engine.index_dtype == "fp8_e4m3",
        cpu_offload_bytes=engine.cpu_offload_bytes * engine.multi_node.size,  # each pod's, over the engine's pods
        scratch_bytes=MXFP8_SCRATCH_BYTES if known.mxfp8 else 0,
    )
    sizing = size(known.weights, known.shape, deployment)
    message = (
        f"{known.name} ({known.weights.total / 1e9:.0f} GB) on parallelism.tensor {engine.tensor_parallel} "
        f"(accelerator.count {engine.accelerator.count}) {engine.accelerator.product}: {sizing.summary()}"
    )
    return Fit("True", MODEL_FITS, message) if sizing.fits else Fit("False", INSUFFICIENT_GPU_MEMORY, message)


def _setting(engine: Engine, field: N | None, flag: str, parse: Callable[[str], N]) -> N | None:
    """The engine's field, else its flag in extraArgs, else None (the engine's own default)."""
    return field if field is not None else _number(engine.extra_args, flag, parse)


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``--flag V`` or ``--flag=V``; the last wins), else None."""
    value = None
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _number(args: Sequence[str], name: str, parse: Callable[[str], N]) -> N | None:
    """A numeric flag of ``args``; None when absent or not a number (the engine refuses that itself)."""
    value = _flag(args, name)
    try:
        return None if value is None else parse(value)
    except ValueError:
        return None
