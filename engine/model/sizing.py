"""An M3 checkpoint's figures for ``m3stack.sizing``, without torch: its weights as the engine will hold them (from
the safetensors headers: dtype per tensor, so MXFP8 weights count 1 byte a value plus their U8 scales, float ones
the serving dtype) placed the way tensor/expert parallelism places them (``engine.distributed.model.shard_piece``:
attention, MLPs, experts and the LM head divided; embeddings, norms and routers on every GPU; vision tower and
projector on the first), and the model's shape for the KV cache and activations.

``release_weights`` counts a checkpoint's tensors from config.json alone, as the MXFP8 release lays them out (the
quantizable linears in FP8 unless ``ignored_layers`` names them): the figures of ``m3stack.sizing``'s released
checkpoints come from it.
"""

from pathlib import Path

from m3stack.engine.model.checkpoint_files import read_header, shard_files
from m3stack.engine.model.config import M3Config, TextConfig
from m3stack.engine.model.quantization import SAFETENSORS_FP8, SAFETENSORS_SCALE, SCALE_SUFFIX, Mxfp8Config
from m3stack.engine.model.weights import checkpoint_tensors, quantizable
from m3stack.sizing import ModelShape, WeightBytes

ONE_BYTE_DTYPES = (SAFETENSORS_FP8, SAFETENSORS_SCALE)


def checkpoint_weights(folder: Path, config: M3Config, serving_bytes: int) -> WeightBytes:
    """The weights of the checkpoint in ``folder`` (headers only), float tensors at ``serving_bytes`` a value."""
    params = _params(config)
    tensors = [
        (params[name], shape, dtype)
        for file in shard_files(folder)
        for name, shape, dtype in read_header(file)
        if name in params
    ]
    return _placed(tensors, serving_bytes)


def release_weights(config: M3Config, quantization: Mxfp8Config | None, serving_bytes: int) -> WeightBytes:
    """The weights a checkpoint for ``config`` holds in the release layout: float, or MXFP8 (``quantization``)."""
    tensors = []
    for spec in checkpoint_tensors(config):
        fp8 = quantization is not None and quantizable(spec.param) and not quantization.ignores(spec.name)
        tensors.append((spec.param, spec.shape, SAFETENSORS_FP8 if fp8 else "BF16"))
        if fp8:
            tensors.append((spec.param, (*spec.shape[:-1], spec.shape[-1] // 32), SAFETENSORS_SCALE))
    return _placed(tensors, serving_bytes)


def model_shape(text: TextConfig) -> ModelShape:
    return ModelShape(
        num_layers=text.num_layers,
        sparse_layers=sum(text.sparse_layers),
        num_kv_heads=text.num_kv_heads,
        head_dim=text.head_dim,
        index_head_dim=text.index_head_dim,
        index_heads=text.index_num_heads,
        block_size=text.index_block_size,
        hidden_size=text.hidden_size,
        moe_intermediate_size=text.moe_intermediate_size,
        experts_per_token=text.num_experts_per_tok,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
    )


def _params(config: M3Config) -> dict[str, str]:
    """Checkpoint tensor name -> the serving parameter it fills (a scale: its weight's parameter)."""
    params = {spec.name: spec.param for spec in checkpoint_tensors(config)}
    return params | {name + SCALE_SUFFIX: param for name, param in params.items()}


def _placed(tensors: list[tuple[str, tuple[int, ...], str]], serving_bytes: int) -> WeightBytes:
    """Bytes by placement of ``(serving parameter, shape, safetensors dtype)`` tensors."""
    split = replicated = leader = 0
    for param, shape, dtype in tensors:
        count = 1
        for size in shape:
            count *= size
        size_bytes = count * (1 if dtype in ONE_BYTE_DTYPES else serving_bytes)
        if param.startswith(("vision.", "projector.")):
            leader += size_bytes
        elif _divided(param):
            split += size_bytes
        else:
            replicated += size_bytes
    return WeightBytes(split=split, replicated=replicated, leader=leader)


def _divided(param: str) -> bool:
    """Whether tensor/expert parallelism divides the parameter over the GPUs (``shard_piece``'s cases)."""
    if param == "lm_head.weight" or param.endswith((".attn.in_proj.weight", ".attn.o_proj.weight")):
        return True
    return ".mlp." in param and ".router." not in param
