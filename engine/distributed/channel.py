"""The messages rank 0 sends the other ranks of a parallel engine: one per model call, and what they carry.

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
Rank 0's runner is unchanged: ``recording.RecordingBackend`` remembers the step's ``AttentionMetadata`` at
``begin_step``, and ``leader.LeaderModel`` sends each forward and logits call before running its own shard; the
workers run them in ``worker.serve_steps``.  Inputs are sent after the runner has filled them on the device (async
scheduling's placeholder tokens included), so workers never need the sampled tokens.  The vision tower runs on
rank 0 only; its embeddings travel with the forward that uses them.
"""

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from m3stack.engine.offload.device import OffloadStep
from m3stack.engine.runtime.cuda_graphs import PaddedDecodeBuffers

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


def all_agree(channel: Channel, flag: bool) -> bool:
    """Every rank: whether ``flag`` holds on all of them (a MIN over the control group)."""
    agreed = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=channel.control)
    return bool(agreed.item())


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
