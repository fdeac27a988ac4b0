"""Fixtures shared by every test folder."""

import os
from pathlib import Path

import pytest

# Without a GPU (CI), Triton kernels run in its CPU interpreter.  The switch is read when a kernel is
# decorated and when triton.language is first imported (its own jit helpers such as tl.cdiv), so it
# must be set before anything imports triton (torch and transformers can): here, pytest's first import.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

REPO_ROOT = Path(__file__).resolve().parent.parent

# One intra-op thread per test process (read by torch when it is first imported): CI runs one xdist worker per
# core, and small tensor ops under oversubscribed OpenMP threads run 10-20x slower on a busy 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Tests that must share one xdist worker, by path (they share one real Kubernetes node and its two cores).
# Not by `xdist_group` marks: with pytest 9.2 and xdist 3.8 the workers' group suffix is lost (xdist writes
# Item._nodeid, which pytest 9.2 no longer reads), so --dist loadgroup spreads marked tests over workers.
SAME_WORKER_PATHS = {"tests/k8s/realnode/": "real-node"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadgroup, with the SAME_WORKER_PATHS groups applied on the controller from node ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PathGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in SAME_WORKER_PATHS.items():
                if nodeid.startswith(prefix):
                    return group
            return super()._split_scope(nodeid)

    return PathGroupScheduling(config, log)


@pytest.fixture(autouse=True)
def normal_cpu_scheduling():
    """Fails a test that leaves its thread on a real-time scheduling policy, and puts SCHED_OTHER back.

    A real-time xdist worker (SVT-AV1 does this to the thread that opens it as root) passes the policy
    on to every process it starts and starves the rest of the run; see media_factory.keep_cpu_scheduling.
    """
    yield
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        pytest.fail("the test left this thread on a real-time CPU scheduling policy (restored to SCHED_OTHER)")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random-weight M3 checkpoint (HF layout + tokenizer + chat template), read-only.

    Generated once into ``$M3STACK_CACHE/models/tiny-<version>`` and shared by every xdist worker through a
    file lock.  Copy it before changing anything in it.
    """
    from m3stack.engine.model.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()
