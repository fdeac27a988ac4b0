"""Rank 0's model in a parallel engine: each forward and logits call goes to every rank, then runs on its shard."""

import logging

import torch
import torch.distributed as dist

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.distributed.channel import (
    Channel,
    Op,
    all_agree,
    broadcast_step_blocks,
    send_message,
    send_staged_step,
)
from m3stack.engine.distributed.model import ShardedM3
from m3stack.engine.distributed.recording import RecordingBackend
from m3stack.engine.kv_cache.tensors import KVCacheSpec
from m3stack.engine.model.vision import Modality
from m3stack.engine.runtime.cuda_graphs import DecodeGraphs, PaddedDecodeBuffers

logger = logging.getLogger(__name__)


class LeaderModel:
    """Rank 0's model for the runner: every forward and logits call goes to all ranks, then runs here.

    A call that fails after its message went out leaves the workers inside a collective that rank 0 will not
    reach: the engine is then unusable, and says so on every later call instead of hanging.
    """

    def __init__(self, model: ShardedM3, channel: Channel) -> None:
        self.model = model
        self.channel = channel
        self.config = model.config
        self.dtype = model.dtype
        self.failure: str | None = None
        self.recorder: RecordingBackend | None = None

    def record(self, backend: AttentionBackend) -> RecordingBackend:
        """Wrap the runner's attention backend: the leader sends the workers what it records of each step (a
        forward carries its own recorder; a graph replay uses this one)."""
        self.recorder = RecordingBackend(backend)
        return self.recorder

    def kv_cache_spec(self, dtype: torch.dtype | None = None) -> KVCacheSpec:
        return self.model.kv_cache_spec(dtype)

    def encode_vision(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, modality: Modality | str
    ) -> torch.Tensor:
        return self.model.encode_vision(pixel_values, grid_thw, modality)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        mm_positions: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(attn, RecordingBackend) or attn.metadata is None:
            raise TypeError("the parallel engine's runner must plan the step through its RecordingBackend")
        self._check()
        md = attn.metadata
        num_rows = 0 if mm_positions is None else int(mm_positions.shape[0])
        ints = [input_ids, positions, md.slot_mapping, md.query_start_loc, md.seq_lens, md.page_table.flatten()]
        if mm_positions is not None:
            ints.append(mm_positions)
        offload = torch.from_numpy(attn.take_offload_ints())
        host = torch.cat([md.query_start_loc_cpu.to(torch.int64), md.seq_lens_cpu.to(torch.int64), offload])
        send_message(
            self.channel,
            [Op.FORWARD, input_ids.shape[0], md.seq_lens.shape[0], md.page_table.shape[1], num_rows, md.block_size,
             len(offload)],
            host,
        )  # fmt: skip
        return self._run(lambda: self._forward(ints, input_ids, positions, attn, mm_positions, mm_embeds))

    def _forward(
        self,
        ints: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        mm_positions: torch.Tensor | None,
        mm_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        dist.broadcast(torch.cat([t.to(torch.int64) for t in ints]), src=0)
        if mm_positions is not None and mm_embeds is not None:
            mm_embeds = mm_embeds.to(self.dtype).contiguous()
            dist.broadcast(mm_embeds, src=0)
        return self.model.forward(input_ids, positions, attn, mm_positions, mm_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._check()
        hidden = hidden.contiguous()
        send_message(self.channel, [Op.LOGITS, hidden.shape[0], hidden.shape[1]])
        return self._run(lambda: self._logits(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        dist.broadcast(hidden, src=0)
        return self.model.compute_logits(hidden)

    # GraphPeers: rank 0's decode graphs capture ``self.model`` (this rank's shard) in step with the workers'.
    def begin_capture(self, graphs: DecodeGraphs) -> None:
        self._check()
        buffers = graphs.buffers
        send_message(self.channel, [Op.CAPTURE, buffers.max_batch, graphs.max_model_len, buffers.block_size])

    def agree(self, captured: bool) -> bool:
        return all_agree(self.channel, captured)

    def send_replay(self, size: int, buffers: PaddedDecodeBuffers) -> None:
        self._check()
        assert self.recorder is not None  # the graphs' backend is the recorder
        send_staged_step(self.channel, size, buffers, self.recorder.take_offload_ints())
        self._run(lambda: broadcast_step_blocks(size, buffers))

    def stop_workers(self) -> None:
        """Tell every worker to leave its loop (the engine is shutting down)."""
        if self.failure is None:
            send_message(self.channel, [Op.STOP])

    def _check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the parallel engine is out of step with its workers since: {self.failure}")

    def _run(self, call):  # type: ignore[no-untyped-def]
        try:
            return call()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.critical("a parallel forward failed after the workers joined it; the engine must restart")
            raise
