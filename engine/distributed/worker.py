"""A worker rank of a parallel engine: receive rank 0's messages and run the same calls on this rank's shard."""

import logging

import torch
import torch.distributed as dist

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.distributed.channel import (
    Channel,
    Message,
    Op,
    all_agree,
    broadcast_step_blocks,
    receive_message,
    receive_staged_step,
)
from m3stack.engine.distributed.model import ShardedM3
from m3stack.engine.kv_cache.metadata import AttentionMetadata
from m3stack.engine.offload.device import DeviceOffload, OffloadStep
from m3stack.engine.runtime.cuda_graphs import DecodeGraphs, PaddedDecodeBuffers

logger = logging.getLogger(__name__)


def _receive_forward(message: Message, model: ShardedM3, channel: Channel) -> tuple:
    num_tokens, num_requests, width, num_rows, block_size, offload_ints = message.values[1:7]
    host = message.host
    starts_cpu, seq_lens_cpu = host[: 2 * num_requests + 1].to(torch.int32).split([num_requests + 1, num_requests])
    offload = OffloadStep.from_ints(host[2 * num_requests + 1 :].numpy()) if offload_ints else None
    sizes = [num_tokens, num_tokens, num_tokens, num_requests + 1, num_requests, num_requests * width, num_rows]
    ints = torch.empty(sum(sizes), dtype=torch.int64, device=channel.device)
    dist.broadcast(ints, src=0)
    ids, positions, slots, starts, seq_lens, pages, rows = ints.split(sizes)
    starts, seq_lens = starts.to(torch.int32), seq_lens.to(torch.int32)
    metadata = AttentionMetadata(
        block_size=block_size,
        query_start_loc=starts,
        seq_lens=seq_lens,
        positions=positions,
        slot_mapping=slots,
        page_table=pages.to(torch.int32).view(num_requests, width),
        query_start_loc_cpu=starts_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    embeds = None
    if num_rows:
        embeds = torch.empty((num_rows, model.config.text.hidden_size), dtype=model.dtype, device=channel.device)
        dist.broadcast(embeds, src=0)
    return metadata, ids, positions, (rows if num_rows else None), embeds, offload


class WorkerGraphPeers:
    """A worker's side of ``GraphPeers``: rank 0 starts captures and replays by message."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def begin_capture(self, graphs: DecodeGraphs) -> None:
        """Rank 0's CAPTURE message started this capture."""

    def agree(self, captured: bool) -> bool:
        return all_agree(self.channel, captured)

    def send_replay(self, size: int, buffers: PaddedDecodeBuffers) -> None:
        raise RuntimeError("only rank 0 starts a replay")


def _apply_offload(offload: DeviceOffload | None, step: OffloadStep | None) -> None:
    if (offload is None) != (step is None):
        raise RuntimeError("rank 0 and this rank disagree on whether the KV cache is offloaded")
    if offload is not None and step is not None:
        offload.apply(step)


class _Planner:
    """Plans a worker's steps.  The attention backend plans from pinned host buffers it reuses, copied up
    asynchronously, so before it plans a step the device must have taken the previous step's copies (rank 0's runner
    waits the same way): a worker never waits for its device otherwise, and would overwrite them in flight."""

    def __init__(self, backend: AttentionBackend, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._copied: torch.cuda.Event | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self.backend.begin_step(metadata)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


@torch.inference_mode()
def serve_steps(
    model: ShardedM3, backend: AttentionBackend, channel: Channel, offload: DeviceOffload | None = None
) -> int:
    """A worker's loop: replay rank 0's calls until STOP; returns the number of forwards run (graphs included).
    ``offload``: this rank's side of CPU KV offload, which applies rank 0's decisions for each step."""
    forwards = 0
    planner = _Planner(backend, channel.device)
    graphs: DecodeGraphs | None = None
    while True:
        message = receive_message(channel)
        header = message.values
        op = header[0]
        if op == Op.FORWARD:
            metadata, ids, positions, rows, embeds, step = _receive_forward(message, model, channel)
            _apply_offload(offload, step)
            planner.plan(metadata)
            model.forward(ids, positions, backend, rows, embeds)
            forwards += 1
        elif op == Op.LOGITS:
            hidden = torch.empty((header[1], header[2]), dtype=model.dtype, device=channel.device)
            dist.broadcast(hidden, src=0)
            model.compute_logits(hidden)
        elif op == Op.CAPTURE:
            if not getattr(backend, "supports_cuda_graphs", False):  # rank 0's backend does: the ranks disagree
                raise RuntimeError(f"{type(backend).__name__} cannot be captured in CUDA graphs, rank 0's can")
            max_batch, max_model_len, block_size = header[1:4]
            graphs = DecodeGraphs(model, backend, channel.device, block_size=block_size, max_batch=max_batch,
                                  max_model_len=max_model_len, peers=WorkerGraphPeers(channel))  # fmt: skip
            graphs.capture()
        elif op == Op.REPLAY:
            if graphs is None or not graphs.captured:
                raise RuntimeError("rank 0 replays a decode graph this rank did not capture")
            size = header[1]
            _apply_offload(offload, receive_staged_step(message, graphs.buffers))
            broadcast_step_blocks(size, graphs.buffers)
            planner.plan(graphs.buffers.metadata(size))
            graphs.replay_planned(size)
            forwards += 1
        elif op == Op.STOP:
            logger.info("rank %d stops after %d forwards", dist.get_rank(), forwards)
            return forwards
        else:
            raise RuntimeError(f"unknown message {header} from rank 0")
