"""Work on M3Deployments asked for by events other than their own: a coalescing queue drained by a
few worker threads.

Child and pod events and the drift loop only *request* work here (a dict insertion in the event
loop, never a blocking call), so a storm of pod events cannot occupy the threads that create and
update resources.  Requests for one resource fold together while it waits or runs; a reconcile
request supersedes a status refresh (a reconcile writes the status too); one resource is never
worked on by two workers at once.  A request may be delayed: the Deployment events of one rollout
then fold into one status refresh, at most ``delay`` after the first of them.
"""

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


class Work(enum.IntEnum):
    REFRESH_STATUS = 1
    RECONCILE = 2


class WorkQueue:
    def __init__(
        self,
        reconcile: Callable[[str, str], None],
        refresh_status: Callable[[str, str], None],
        workers: int,
        expected_errors: tuple[type[Exception], ...] = (),
    ) -> None:
        self._functions = {Work.RECONCILE: reconcile, Work.REFRESH_STATUS: refresh_status}
        self._workers = workers
        self._expected_errors = expected_errors
        self._pending: dict[Key, tuple[Work, float]] = {}  # key -> (work, due on the loop's clock)
        self._running: set[Key] = set()
        self._wakeup = asyncio.Event()

    def request(self, key: Key, work: Work, delay: float = 0.0) -> None:
        """Asks for ``work`` on ``key`` within ``delay`` seconds (call from the event loop; never blocks)."""
        due = asyncio.get_running_loop().time() + delay
        if key in self._pending:
            earlier_work, earlier_due = self._pending[key]
            work, due = max(work, earlier_work), min(due, earlier_due)
        self._pending[key] = (work, due)
        self._wakeup.set()

    @property
    def depth(self) -> int:
        """Resources waiting for work (not those being worked on)."""
        return len(self._pending)

    @property
    def idle(self) -> bool:
        return not self._pending and not self._running

    async def run(self) -> None:
        """Drains the queue forever (cancel to stop)."""
        pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="workqueue")
        slots = asyncio.Semaphore(self._workers)
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        try:
            while True:
                now = loop.time()
                waiting = {key: entry for key, entry in self._pending.items() if key not in self._running}
                for key, (work, due) in waiting.items():
                    if due <= now:
                        del self._pending[key]
                        self._running.add(key)
                        task = asyncio.create_task(self._do(pool, slots, key, work))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                later = [due for key, (_, due) in waiting.items() if key in self._pending]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout=max(0.0, min(later) - now) if later else None)
                self._wakeup.clear()
        finally:
            for task in tasks:
                task.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    async def _do(self, pool: ThreadPoolExecutor, slots: asyncio.Semaphore, key: Key, work: Work) -> None:
        try:
            async with slots:
                await asyncio.get_running_loop().run_in_executor(pool, self._functions[work], *key)
        except Exception as error:  # one resource's failure must not stop the others; the drift loop retries
            unexpected = not isinstance(error, self._expected_errors)
            logger.warning("%s of %s/%s failed: %s", work.name.lower(), *key, error, exc_info=unexpected)
        finally:
            self._running.discard(key)
            if key in self._pending:
                self._wakeup.set()
