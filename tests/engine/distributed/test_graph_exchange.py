"""The decode-graph replay message between two real processes over gloo: rank 0's staged step (its host part in
the message, its device blocks after it) reaches a worker's own padded buffers whole, so the worker plans and
replays exactly rank 0's step.

(The CUDA graphs themselves need GPUs: tests/gpu/test_multi_gpu.py replays them on two H200s.)
"""

import multiprocessing
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from m3stack.engine.distributed.channel import (
    INLINE_INTS,
    Channel,
    Op,
    broadcast_step_blocks,
    receive_message,
    receive_staged_step,
    send_message,
    send_staged_step,
)
from m3stack.engine.distributed.processes import free_port
from m3stack.engine.runtime.cuda_graphs import PaddedDecodeBuffers
from m3stack.engine.runtime.inputs import HostInputs

BLOCK, MAX_BATCH, MAX_LEN = 4, 8, 40
# (requests, widest page) of consecutive steps: a wide batch, then a narrower one with fewer pages, which must not
# keep the wide one's page ids on either rank.
STEPS = [(7, 10), (3, 4), (5, 7)]


def _decode_step(num_requests: int, pages: int, seed: int) -> HostInputs:
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, pages * BLOCK + 1, num_requests).astype(np.int32)
    seq_lens[0] = pages * BLOCK
    table = np.zeros((num_requests, pages), dtype=np.int32)
    for row, length in enumerate(seq_lens):
        used = -(-int(length) // BLOCK)
        table[row, :used] = rng.integers(1, 100, used)
    positions = (seq_lens - 1).astype(np.int64)
    slots = table[np.arange(num_requests), positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    none = np.zeros(0, dtype=np.int64)
    return HostInputs(
        input_ids=rng.integers(0, 1000, num_requests), positions=positions,
        query_start_loc=np.arange(num_requests + 1, dtype=np.int32), seq_lens=seq_lens, slot_mapping=slots,
        page_table=table, logits_rows=np.arange(num_requests), sampling_requests=[], mm_rows=none, mm_slices=[],
        placeholder_rows=none, placeholder_requests=[],
    )  # fmt: skip


def _buffers() -> PaddedDecodeBuffers:
    return PaddedDecodeBuffers(torch.device("cpu"), block_size=BLOCK, max_batch=MAX_BATCH, max_model_len=MAX_LEN)


def _padded(count: int) -> int:
    return 8 if count > 4 else 4


def _rank(rank: int, port: int, failures: multiprocessing.Queue) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        channel = Channel(dist.new_group(backend="gloo"), torch.device("cpu"))
        buffers, expected = _buffers(), _buffers()
        for index, (count, pages) in enumerate(STEPS):
            host, size = _decode_step(count, pages, seed=index), _padded(count)
            want = expected.stage(host, size)
            if rank == 0:
                buffers.stage(host, size)
                send_staged_step(channel, size, buffers, np.zeros(0, dtype=np.int64))
            else:
                message = receive_message(channel)
                if message.values[:2] != [Op.REPLAY, size] or receive_staged_step(message, buffers) is not None:
                    raise AssertionError(f"rank 1, step {index}: {message}")
            broadcast_step_blocks(size, buffers)
            got = buffers.metadata(size)
            for field in ("query_start_loc", "seq_lens", "positions", "slot_mapping", "page_table", "seq_lens_cpu",
                          "query_start_loc_cpu"):  # fmt: skip
                if not torch.equal(getattr(got, field), getattr(want, field)):
                    raise AssertionError(f"rank {rank}, step {index}: {field} {getattr(got, field)}")
            if not torch.equal(buffers.input_ids[:size], expected.input_ids[:size]):
                raise AssertionError(f"rank {rank}, step {index}: input ids differ")
        # Host integers beyond what rides in the header follow it in a broadcast of their own.
        long_host = torch.arange(INLINE_INTS * 3 + 5, dtype=torch.int64)
        if rank == 0:
            send_message(channel, [Op.FORWARD, 7], long_host)
        else:
            message = receive_message(channel)
            if message.values[:2] != [Op.FORWARD, 7] or not torch.equal(message.host, long_host):
                raise AssertionError(f"rank 1: a long message arrived as {message.values}, {len(message.host)} ints")
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def test_a_replayed_step_reaches_the_worker_whole() -> None:
    context = multiprocessing.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, failures)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors, errors
    assert [process.exitcode for process in ranks] == [0, 0]
