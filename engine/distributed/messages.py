"""Rank 0 tells the other ranks what to run; they run it.  One message per model call.

A message is a fixed-size header broadcast over the control group (gloo, host memory: a waiting worker blocks
on a socket, not on a GPU collective that would time out while the engine is idle) carrying its sizes and up to
``INLINE_INTS`` host integers (longer ones follow in a second broadcast), then its tensors over the default group
(NCCL on GPUs), sent straight from rank 0's device buffers with no host round trip::

    FORWARD  [T, R, P, M, block_size, K]
                                       host: query starts, context lengths (what the attention backend plans
                                       from), then the step's K-integer ``OffloadStep`` with CPU KV offload;
                                       device ints [3T + 2R + 1 + R*P + M] (ids, positions, slots, query starts,
                                       context lengths, page table, vision rows), then vision embeddings [M, H]
    LOGITS   [n, H]                    the hidden rows whose logits are sampled [n, H]
    CAPTURE  [max_batch, max_len, B]   capture decode CUDA graphs of every padded size, in step with rank 0
    REPLAY   [size]                    host: context lengths [size], then the ``OffloadStep`` with offload;
                                       rank 0's staged decode buffers (``PaddedDecodeBuffers.step_blocks``):
                                       plan them, replay the graph of size
    STOP     []                        the engine is shutting down

The host copies travel over gloo so that a worker never waits for its device: it plans and enqueues a step while
the previous one still runs, as rank 0 does (reading them back from the device waited for rank 0's broadcast,
which rank 0 enqueues behind its previous step, so a worker launched each step only after the last one ended).
Rank 0's runner is unchanged: ``RecordingBackend`` remembers the step's ``AttentionMetadata`` at
``begin_step``, and ``LeaderModel`` sends each forward and logits call before running its own shard.  Inputs
are sent after the runner has filled them on the device (async scheduling's placeholder tokens included), so
workers never need the sampled tokens.  The vision tower runs on rank 0 only; its embeddings travel with the
forward that uses them.
"""

import enum
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from m3stack.engine.attention.backend import AttentionBackend
from m3stack.engine.attention.metadata import AttentionMetadata
from m3stack.engine.distributed.model import ShardedM3
from m3stack.engine.kv_cache.tensors import KVCacheSpec
from m3stack.engine.model.vision import Modality
from m3stack.engine.offload.device import DeviceOffload, OffloadStep
from m3stack.engine.runtime.cuda_graphs import DecodeGraphs, PaddedDecodeBuffers

logger = logging.getLogger(__name__)

HEADER_LEN = 8
# Host integers that ride in the header's own broadcast: a decode step's context lengths and offload decisions
# fit, so a step costs one gloo round trip (125-175 us each on a 2-core machine, 2026-12-01), not two or three.
INLINE_INTS = 1024


class Op(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2
    STOP = 3
    CAPTURE = 4
    REPLAY = 5


@dataclass(frozen=True)
class Channel:
    control: dist.ProcessGroup  # gloo: headers
    device: torch.device  # where the tensors of a message live (the default group's device)


@dataclass(frozen=True)
class Message:
    values: list[int]  # the op, then its sizes (HEADER_LEN)
    host: torch.Tensor  # its host integers, int64


def send_message(channel: Channel, values: list[int], host: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast a message over the control group."""
    host = torch.zeros(0, dtype=torch.int64) if host is None else host.to(torch.int64)
    frame = torch.zeros(HEADER_LEN + 1 + INLINE_INTS, dtype=torch.int64)
    frame[: len(values)] = torch.tensor(values, dtype=torch.int64)
    frame[HEADER_LEN] = len(host)
    inline = len(host) <= INLINE_INTS
    if inline:
        frame[HEADER_LEN + 1 : HEADER_LEN + 1 + len(host)] = host
    dist.broadcast(frame, src=0, group=channel.control)
    if not inline:
        dist.broadcast(host.contiguous(), src=0, group=channel.control)


class LostRankError(RuntimeError):
    """The control group broke while a worker waited for rank 0's next message: a rank of the engine is gone."""


def receive_message(channel: Channel) -> Message:
    """A worker: the next message from rank 0 (blocks until it comes)."""
    frame = torch.empty(HEADER_LEN + 1 + INLINE_INTS, dtype=torch.int64)
    try:
        dist.broadcast(frame, src=0, group=channel.control)
    except RuntimeError as exc:  # gloo: "Connection closed by peer", the other side's process ended
        raise LostRankError(str(exc)) from exc
    count = int(frame[HEADER_LEN])
    if count <= INLINE_INTS:
        host = frame[HEADER_LEN + 1 : HEADER_LEN + 1 + count]
    else:
        host = torch.empty(count, dtype=torch.int64)
        dist.broadcast(host, src=0, group=channel.control)
    return Message(frame[:HEADER_LEN].tolist(), host)


class RecordingBackend:
    """Rank 0's attention backend, remembering what the workers need of the step being planned: its metadata, and
    with CPU KV offload the offload decisions the runner applied just before (``DeviceOffload.last_step``)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.metadata: AttentionMetadata | None = None
        self.offload: DeviceOffload | None = getattr(inner, "offload", None)
        self.offload_step: OffloadStep | None = None

    @property
    def supports_cuda_graphs(self) -> bool:
        return bool(getattr(self.inner, "supports_cuda_graphs", False))

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        if self.offload is not None:
            self.offload_step, self.offload.last_step = self.offload.last_step, None
        self.inner.begin_step(metadata)

    def take_offload_ints(self) -> np.ndarray:
        """The recorded offload step as integers, once (empty without offload)."""
        if self.offload is None:
            return np.zeros(0, dtype=np.int64)
        if self.offload_step is None:
            raise RuntimeError("a step with CPU KV offload was planned without its offload decisions")
        step, self.offload_step = self.offload_step, None
        return step.to_ints()

    def dense(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner.dense(layer, q, k, v)

    def sparse(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        return self.inner.sparse(layer, q, k, v, index_q, index_k)


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
        return _all_captured(self.channel, captured)

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


def _all_captured(channel: Channel, captured: bool) -> bool:
    flag = torch.tensor([int(captured)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=channel.control)
    return bool(flag.item())


def send_staged_step(channel: Channel, size: int, buffers: PaddedDecodeBuffers, offload_ints: np.ndarray) -> None:
    """Rank 0: the REPLAY message of the decode step staged in ``buffers`` (its host part)."""
    host = torch.cat([buffers.host_seq_lens(size).to(torch.int64), torch.from_numpy(offload_ints)])
    send_message(channel, [Op.REPLAY, size], host)


def receive_staged_step(message: Message, buffers: PaddedDecodeBuffers) -> OffloadStep | None:
    """A worker: a REPLAY message's host part into this rank's buffers; its offload decisions, if any."""
    size = message.values[1]
    buffers.host_seq_lens(size)[:] = message.host[:size]
    return OffloadStep.from_ints(message.host[size:].numpy()) if len(message.host) > size else None


def broadcast_step_blocks(size: int, buffers: PaddedDecodeBuffers) -> None:
    """Rank 0's staged decode step's device blocks into every rank's buffers (the same layout on all of them)."""
    for block in buffers.step_blocks(size):
        dist.broadcast(block, src=0)


class WorkerGraphPeers:
    """A worker's side of ``GraphPeers``: rank 0 starts captures and replays by message."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def begin_capture(self, graphs: DecodeGraphs) -> None:
        """Rank 0's CAPTURE message started this capture."""

    def agree(self, captured: bool) -> bool:
        return _all_captured(self.channel, captured)

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
