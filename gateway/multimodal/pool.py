"""A process pool for CPU-bound media jobs, with a deadline per job.

Threads would serialize on the GIL, and a decoder stuck in native code cannot be interrupted, so each
job runs in a worker process; a job past its deadline gets its worker killed and replaced, and the
caller gets a :class:`MediaError`.  A worker that dies mid-job (a decoder crash on hostile input)
is replaced the same way.  Workers are spawned (never forked from the threaded server).
"""

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

from .errors import MediaError

logger = logging.getLogger(__name__)

Job = Callable[..., Any]


def default_worker_count() -> int:
    return max(1, len(os.sched_getaffinity(0)))


STARTUP_TIMEOUT_S = 120.0


class _Worker:
    def __init__(self, context: multiprocessing.context.SpawnContext, warmup: Job | None) -> None:
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child, warmup), daemon=True, name="m3stack-media")
        self.process.start()
        child.close()
        # Wait for the worker's "ready" so a pool that cannot start fails here, not on a request.
        if not self.conn.poll(STARTUP_TIMEOUT_S) or self._ready_message() != "ready":
            self.kill()
            raise RuntimeError(f"a media worker did not start (exit code {self.process.exitcode})")

    def _ready_message(self) -> str | None:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    def __init__(self, workers: int | None = None, warmup: Job | None = None) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._warmup = warmup
        self._size = workers or default_worker_count()
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._reclaiming: set[asyncio.Future] = set()

    @property
    def size(self) -> int:
        return self._size

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self._size):
            worker = await asyncio.to_thread(_Worker, self._context, self._warmup)
            self._all.add(worker)
            self._idle.put_nowait(worker)
        logger.info("media worker pool started with %d processes", self._size)

    async def close(self) -> None:
        for worker in list(self._all):
            await asyncio.to_thread(worker.kill)
        self._all.clear()

    async def run(self, job: Job, *args: Any, timeout_s: float) -> Any:
        """``job(*args)`` in a worker; ``job`` must be a module-level function and its arguments picklable."""
        if self._idle is None:
            raise RuntimeError("WorkerPool.start() was not awaited")
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        call = asyncio.ensure_future(self._call(worker, job, args))
        try:
            status, value = await asyncio.wait_for(asyncio.shield(call), timeout=timeout_s)
        except TimeoutError:
            call.cancel()
            await self._replace(worker)
            raise MediaError(f"processing the media took longer than {timeout_s:g}s", "media_timeout") from None
        except (EOFError, OSError):
            await self._replace(worker)
            raise MediaError("the media crashed its decoder", "invalid_media") from None
        except asyncio.CancelledError:
            # The caller gave up (client gone, a sibling item failed): the job runs out in the background
            # and its worker comes back, instead of a kill and a fresh spawn.
            reclaim = asyncio.ensure_future(self._reclaim(worker, call, deadline))
            self._reclaiming.add(reclaim)
            reclaim.add_done_callback(self._reclaiming.discard)
            raise
        self._idle.put_nowait(worker)
        if status == "ok":
            return value
        if status == "media_error":
            raise MediaError(*value)
        logger.error("media job %s failed:\n%s", getattr(job, "__name__", job), value)
        raise MediaError("processing the media failed unexpectedly", "media_processing_failed", status=500)

    async def _call(self, worker: _Worker, job: Job, args: tuple[Any, ...]) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(worker.conn.send, (job, args))
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        return worker.conn.recv()

    async def _reclaim(self, worker: _Worker, call: asyncio.Future, deadline: float) -> None:
        try:
            await asyncio.wait_for(call, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        except (TimeoutError, EOFError, OSError):
            call.cancel()
            await self._replace(worker)
            return
        assert self._idle is not None
        self._idle.put_nowait(worker)

    async def _replace(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await asyncio.to_thread(worker.kill)
        fresh = await asyncio.to_thread(_Worker, self._context, self._warmup)
        self._all.add(fresh)
        assert self._idle is not None
        self._idle.put_nowait(fresh)


def _worker_main(conn: multiprocessing.connection.Connection, warmup: Job | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when workers stop
    if warmup is not None:
        warmup()
    conn.send("ready")
    while True:
        try:
            job, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", job(*args))
        except MediaError as exc:
            reply = ("media_error", (exc.message, exc.code, exc.status, exc.param))
        except Exception:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
