"""The processes and process groups of a parallel engine: start a node's ranks, watch them, join and leave groups.

Mechanics only: what each rank builds and runs is the composition root's (``engine.assembly.parallel``), which
hands ``spawn_ranks`` the function a spawned rank runs.  A rank that ends unasked ends its node's engine process
(``RankWatch``): the group cannot go on without it.
"""

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from m3stack.engine.distributed.channel import Channel
from m3stack.engine.distributed.config import MULTICAST_OFF_ENV, ParallelConfig

logger = logging.getLogger(__name__)

# How long a worker may wait for rank 0's next message: an idle engine sends none.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
STOP_JOIN_SECONDS = 30.0
LOST_RANK_EXIT_CODE = 1


def disable_multicast() -> None:
    """Before any CUDA/NCCL initialisation, and inherited by every process started from here."""
    for name, value in MULTICAST_OFF_ENV.items():
        os.environ[name] = value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_device(device: str, local_rank: int) -> torch.device:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} needs GPU {local_rank}, but this node has {torch.cuda.device_count()}"
        )
    return torch.device("cuda", local_rank)


def join_process_groups(
    parallel: ParallelConfig, rank: int, device: torch.device, collectives: str | None = None
) -> Channel:
    """Join the engine's default group (NCCL on GPUs, gloo on CPU, or ``collectives``) and its gloo control group.

    gloo also moves CUDA tensors, slowly and outside CUDA graphs: what lets tests put two ranks on one GPU, which
    NCCL refuses.
    """
    address = f"tcp://{parallel.master_addr}:{parallel.master_port}"
    logger.info("rank %d/%d (%s) joining %s", rank, parallel.tensor_parallel, device, address)
    backend = collectives or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=parallel.tensor_parallel,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if backend == "nccl" else None,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Channel(control, device)


def spawn_ranks(
    parallel: ParallelConfig, run_rank: Callable[[object, int, int], None], settings: object
) -> list[multiprocessing.process.BaseProcess]:
    """This node's ranks after its first one, as child processes running ``run_rank(settings, rank, local_rank)``
    (both picklable: the processes are spawned)."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for local_rank in range(1, parallel.ranks_per_node):
        rank = parallel.first_rank + local_rank
        process = context.Process(
            target=run_rank, args=(settings, rank, local_rank), name=f"m3stack-rank{rank}", daemon=True
        )
        process.start()
        processes.append(process)
    return processes


def init_spawned_rank() -> None:
    """In a rank ``spawn_ranks`` started: log as the engine does, exit with the process that started it."""
    from m3stack.logs import configure_logging

    configure_logging()
    _watch_parent()
    # A terminal's Ctrl-C reaches every process of its group: the node's first rank drains, then stops the
    # others itself (STOP), so they must outlive the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class RankWatch:
    """Ends this process as soon as one of the ranks it started ends unasked (killed, crashed, out of memory).

    The other ranks would otherwise wait for it in their next collective for the whole timeout (30 minutes for
    NCCL, forever for an idle engine, which runs none) while the server kept reporting itself healthy.  Exiting
    hands the restart to whoever supervises the engine: ``m3stack up``, the kubelet, LeaderWorkerSet (which
    recreates the whole group).  A rank asked to stop exits with 0, or is killed after ``expect_exit``.
    """

    def __init__(self, processes: list[multiprocessing.process.BaseProcess]) -> None:
        self.processes = processes
        self.expected = threading.Event()
        if processes:
            threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def expect_exit(self) -> None:
        self.expected.set()

    def _watch(self) -> None:
        ended = multiprocessing.connection.wait([process.sentinel for process in self.processes])
        lost = next(process for process in self.processes if process.sentinel in ended)
        lost.join()  # ended: sets exitcode
        if self.expected.is_set() or lost.exitcode == 0:
            return
        logger.critical(
            "%s (pid %s) exited with code %s; the engine cannot run without one of its ranks, so it exits too",
            lost.name, lost.pid, lost.exitcode,
        )  # fmt: skip
        for process in self.processes:
            if process.is_alive():
                process.kill()
        os._exit(LOST_RANK_EXIT_CODE)


def _watch_parent() -> None:
    """A spawned rank exits when the process that started it is gone (killed engines leave no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def leave_process_group(timeout_s: float) -> None:
    """Leave the default process group, waiting at most ``timeout_s`` for the other ranks.

    NCCL's teardown returns on a rank only once every rank has reached it, so rank 0 leaves while its
    stopped workers leave, never after joining them (that waited out the join timeout on every stop); a
    worker that died must not hang rank 0's shutdown either, hence the thread and the bound.
    """
    if not dist.is_initialized():
        return
    leaving = threading.Thread(target=dist.destroy_process_group, name="leave-process-group", daemon=True)
    leaving.start()
    leaving.join(timeout_s)
    if leaving.is_alive():
        logger.warning("the other ranks did not leave the process group within %.0f s", timeout_s)
