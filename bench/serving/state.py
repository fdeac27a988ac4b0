"""``Bench``: what every config shares (model, workload, flags, budget clock, results so far) and the engine
settings of each config sized from them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import write_results
from bench.serving.client import ClientProcess
from bench.serving.workload import Workload
from m3stack.engine.assembly.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from m3stack.engine.model.config import M3Config
    from m3stack.engine.model.model import M3ForServing

logger = logging.getLogger("bench.serving")

FINAL_S = 2.0  # kept back from the whole budget: the last write


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """How a config's engine differs from the others'."""

    attention: str  # "msa" (``--msa-attention``), "dense" or "naive"
    offload: bool = False  # CPU KV offload
    fp8_caches: bool = False  # fp8 k-index and KV cache (--index-dtype / --kv-cache-dtype fp8_e4m3)
    mxfp8_weights: bool = False  # the model's linears in MXFP8, quantized from the bf16 ones (engine.mxfp8_copy)


CONFIGS = {
    "a": ConfigSpec("msa"),
    "b": ConfigSpec("dense"),
    "c": ConfigSpec("naive"),
    "d": ConfigSpec("msa", offload=True),
    "e": ConfigSpec("msa", fp8_caches=True),
    "f": ConfigSpec("msa", mxfp8_weights=True),
}
# What a run measures unless --configs says otherwise.
DEFAULT_CONFIGS = ["a", "b", "c", "d"]


@dataclasses.dataclass
class Bench:
    """What every config shares: the model, the workload, the flags, the budget clock and the results so far."""

    args: argparse.Namespace
    model: M3ForServing
    m3: M3Config
    device: torch.device
    dtype: torch.dtype
    workload: Workload
    deadline: float  # time.monotonic() by which everything must be written
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tokens: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)  # config -> key -> tokens
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    client: ClientProcess | None = None

    @property
    def block_size(self) -> int:
        return self.m3.text.index_block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def prefix_blocks(self) -> int:
        """Blocks of the shared prefix that requests share (full ones only)."""
        return self.workload.prefix_tokens // self.block_size

    def own_blocks(self, new_tokens: int) -> int:
        """Blocks a warm request holds alone: its suffix, its output and the prefix's partial last block."""
        return self.blocks(self.workload.prompt_tokens + new_tokens) - self.prefix_blocks

    def offload_device_blocks(self) -> int:
        """Device blocks of the offload configs: the shared prefix, half the largest point's own blocks, and one
        hot buffer, so the largest points run short of device memory."""
        if self.args.offload_device_blocks:
            return self.args.offload_device_blocks
        own = self.own_blocks(self.workload.output_tokens)
        return self.prefix_blocks + math.ceil(max(self.args.concurrency) * own / 2) + self.hot_blocks()

    def hot_blocks(self) -> int:
        """Device pages of one request's hot buffer (engine.offload's default)."""
        from m3stack.engine.assembly.offload import OffloadSettings, resolve_hot_blocks

        return resolve_hot_blocks(OffloadSettings(1.0), self.m3.text)

    def engine_config(self, name: str, *, max_num_seqs: int, max_model_len: int, device_blocks: int,
                      host_blocks: int) -> EngineConfig:  # fmt: skip
        from m3stack.engine.offload.layout import host_bytes_per_block

        offload_gb = 0.0
        if CONFIGS[name].offload:  # the engine caps prefill chunks to what its device pool can place
            device_blocks = self.offload_device_blocks()
            spec = self.model.kv_cache_spec(self.dtype)
            offload_gb = self.args.offload_gb or (host_blocks + 1) * host_bytes_per_block(spec) / 2**30
        return EngineConfig(device=self.device.type, dtype=str(self.dtype).removeprefix("torch."),
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=self.args.max_num_batched_tokens,
                            max_model_len=max_model_len, num_kv_blocks=device_blocks, attention=self.attention(name),
                            kv_offload_gb=offload_gb, seed=self.args.seed,
                            msa_shared_page_scan=self.args.shared_page_scan,
                            index_dtype="fp8_e4m3" if CONFIGS[name].fp8_caches else "auto",
                            kv_cache_dtype="fp8_e4m3" if CONFIGS[name].fp8_caches else "auto")  # fmt: skip

    def attention(self, name: str) -> str:
        attention = CONFIGS[name].attention
        return self.args.msa_attention if attention == "msa" else attention

    def weights(self, name: str) -> str:
        """The format of config ``name``'s weights: ``mxfp8``, or the model dtype."""
        return "mxfp8" if CONFIGS[name].mxfp8_weights else str(self.dtype).removeprefix("torch.")

    def row_fields(self, name: str) -> dict[str, Any]:
        """The fields naming config ``name`` in each of its rows."""
        return {"config": name, "attention": self.attention(name), "offload": CONFIGS[name].offload,
                "weights": self.weights(name)}  # fmt: skip

    def describe(self, name: str, config: EngineConfig) -> dict[str, Any]:
        """The row fields naming the config, and (in ``extra["engines"]``) its settings that differ from defaults."""
        default = EngineConfig()
        self.extra["engines"][name] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                       if getattr(config, f.name) != getattr(default, f.name)}  # fmt: skip
        return self.row_fields(name.removesuffix("-long"))

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        logger.info("%s", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        self.save()

    def save(self) -> Path:
        self.extra["elapsed_s"] = self.args.budget_s - (self.deadline + FINAL_S - time.monotonic())
        return write_results(self.args.name, self.rows, self.extra, out_dir=self.args.out)
