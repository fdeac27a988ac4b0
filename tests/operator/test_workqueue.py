"""The work queue: requests fold per resource, a reconcile supersedes a status refresh, one resource
is never worked on twice at once, and the number of workers bounds concurrency."""

import asyncio
import threading
import time

from m3stack.operator.workqueue import Work, WorkQueue


class Recorder:
    """Stands in for the Reconciler: records calls, optionally holding them until released."""

    def __init__(self, hold: bool = False) -> None:
        self.calls: list[tuple[str, tuple[str, str]]] = []
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def _record(self, what: str, namespace: str, name: str) -> None:
        with self.lock:
            self.calls.append((what, (namespace, name)))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        self.release.wait(5)
        time.sleep(0.01)
        with self.lock:
            self.running -= 1

    def reconcile(self, namespace: str, name: str) -> None:
        self._record("reconcile", namespace, name)

    def refresh(self, namespace: str, name: str) -> None:
        self._record("refresh", namespace, name)


async def _drain(queue: WorkQueue, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not queue.idle:
        assert time.monotonic() < deadline, "the queue did not drain"
        await asyncio.sleep(0.01)


def _run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=20))


def test_requests_fold_and_reconcile_wins():
    recorder = Recorder()

    async def scenario() -> None:
        queue = WorkQueue(recorder.reconcile, recorder.refresh, workers=2)
        for _ in range(20):
            queue.request(("ns", "a"), Work.REFRESH_STATUS)
        queue.request(("ns", "a"), Work.RECONCILE)
        queue.request(("ns", "a"), Work.REFRESH_STATUS)
        queue.request(("ns", "b"), Work.REFRESH_STATUS)
        runner = asyncio.create_task(queue.run())
        await _drain(queue)
        runner.cancel()

    _run(scenario)
    assert sorted(recorder.calls) == [("reconcile", ("ns", "a")), ("refresh", ("ns", "b"))]


def test_one_resource_is_never_worked_on_twice_at_once_and_later_requests_run_after():
    recorder = Recorder(hold=True)

    async def scenario() -> None:
        queue = WorkQueue(recorder.reconcile, recorder.refresh, workers=4)
        runner = asyncio.create_task(queue.run())
        queue.request(("ns", "a"), Work.REFRESH_STATUS)
        while not recorder.calls:
            await asyncio.sleep(0.01)
        for _ in range(5):  # arrive while the first run is in progress
            queue.request(("ns", "a"), Work.REFRESH_STATUS)
        await asyncio.sleep(0.1)
        assert recorder.running == 1
        recorder.release.set()
        await _drain(queue)
        runner.cancel()

    _run(scenario)
    assert recorder.calls == [("refresh", ("ns", "a"))] * 2
    assert recorder.most_running == 1


def test_workers_bound_the_concurrency():
    recorder = Recorder(hold=True)

    async def scenario() -> None:
        queue = WorkQueue(recorder.reconcile, recorder.refresh, workers=3)
        runner = asyncio.create_task(queue.run())
        for index in range(10):
            queue.request(("ns", f"r{index}"), Work.RECONCILE)
        await asyncio.sleep(0.2)
        assert recorder.running == 3
        recorder.release.set()
        await _drain(queue)
        runner.cancel()

    _run(scenario)
    assert len(recorder.calls) == 10
    assert recorder.most_running == 3


def test_a_failure_is_logged_and_the_queue_goes_on(caplog):
    calls: list[str] = []

    def failing(namespace: str, name: str) -> None:
        calls.append(name)
        if name == "bad":
            raise RuntimeError("boom")

    async def scenario() -> None:
        queue = WorkQueue(failing, failing, workers=1, expected_errors=(RuntimeError,))
        runner = asyncio.create_task(queue.run())
        queue.request(("ns", "bad"), Work.RECONCILE)
        await _drain(queue)
        queue.request(("ns", "good"), Work.RECONCILE)
        await _drain(queue)
        runner.cancel()

    _run(scenario)
    assert calls == ["bad", "good"]
    assert "reconcile of ns/bad failed: boom" in caplog.text


def test_delayed_requests_fold_into_one_run_at_the_first_deadline():
    recorder = Recorder()

    async def scenario() -> None:
        queue = WorkQueue(recorder.reconcile, recorder.refresh, workers=2)
        runner = asyncio.create_task(queue.run())
        started = asyncio.get_running_loop().time()
        # The last request comes 1.2 s in: pushed back by it, the run would start at 3.2 s, not 2 s.
        # Wide margins, so that a loaded CI machine cannot blur the two.
        for _ in range(4):
            queue.request(("ns", "a"), Work.REFRESH_STATUS, delay=2.0)
            await asyncio.sleep(0.4)
        assert recorder.calls == [], "nothing runs before the delay"
        await _drain(queue, timeout=5.0)
        elapsed = asyncio.get_running_loop().time() - started
        assert 2.0 <= elapsed < 3.0, "due at the first request's deadline, not pushed back by later ones"
        queue.request(("ns", "b"), Work.REFRESH_STATUS, delay=5.0)
        queue.request(("ns", "b"), Work.RECONCILE)
        await _drain(queue, timeout=1.0)
        runner.cancel()

    _run(scenario)
    assert recorder.calls == [("refresh", ("ns", "a")), ("reconcile", ("ns", "b"))]
