"""Triton kernel specializations this process meets, counted and timed, so a compile mid-serving shows.

Triton compiles (or loads from its disk cache) a kernel the first time a launch meets a new
specialization: other constexprs, dtypes, integer arguments of another class (1, multiples of 16).
On an H200 host that takes up to seconds, and every request in the batch stalls meanwhile, so the
kernels leave step-varying counts unspecialized (``do_not_specialize``) and the warm-up and CUDA-graph
capture meet the rest.  ``watch()`` installs Triton's JIT hooks (before and after each such compile,
chaining any hooks already set) to count them and their seconds; ``snapshot()`` reads the totals, so a
benchmark can show compiles inside a timed point, and each one is logged with its kernel and constexprs.
"""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileTotals:
    count: int
    seconds: float


class _Watch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self._thread = threading.local()  # a compile runs in the launching thread, between the two hooks
        self.previous_before: Any = None
        self.previous_after: Any = None

    def before(self, **kwargs: Any) -> bool | None:
        """Triton's ``jit_cache_hook``: a new specialization is about to be compiled (or loaded)."""
        self._thread.started = time.perf_counter()
        return self.previous_before(**kwargs) if self.previous_before is not None else None

    def after(self, **kwargs: Any) -> bool | None:
        """Triton's ``jit_post_compile_hook``: the specialization is ready."""
        now = time.perf_counter()
        started = getattr(self._thread, "started", now)
        with self._lock:
            self.count += 1
            self.seconds += now - started
        fn = kwargs.get("fn")
        compile_info = kwargs.get("compile", {})
        logger.info("compiled %s in %.2f s (%s; %s)", getattr(fn, "name", fn), now - started,
                    _describe(compile_info.get("constants", {})), _describe_attributes(compile_info))  # fmt: skip
        return self.previous_after(**kwargs) if self.previous_after is not None else None


def _describe(constants: dict) -> str:
    """Constexprs by name where Triton gives them as (path,) -> value pairs."""
    return ", ".join(f"{key[-1] if isinstance(key, tuple) else key}={value}" for key, value in constants.items())


def _describe_attributes(compile_info: dict) -> str:
    """The rest of the specialization: the arguments Triton compiled as divisible by 16 (integers) or 16-byte
    aligned (pointers).  Two compiles of one kernel with equal constexprs differ here, which names the argument
    that changed class (a stride, a count, a tensor's offset)."""
    names = list(compile_info.get("signature", {}))
    configs = compile_info.get("configs") or [{}]
    marked = []
    for path, attributes in sorted(configs[0].items()):
        if not attributes:  # every non-constexpr argument has an entry; most have no attribute
            continue
        index = path[0] if isinstance(path, tuple) and path else path
        name = names[index] if isinstance(index, int) and index < len(names) else str(path)
        marked.append(name if "divisibility" in str(attributes) else f"{name}:{attributes}")
    return "16-aligned: " + (", ".join(marked) if marked else "none")


_watch = _Watch()
_installed = False
_install_lock = threading.Lock()


def watch() -> bool:
    """Install the hooks (once per process); False where this Triton has no JIT hooks."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        _watch.previous_before, _watch.previous_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = _watch.before, _watch.after
        _installed = True
        return True


def snapshot() -> CompileTotals:
    """Specializations compiled (or loaded) since ``watch()``, and the seconds they took."""
    with _watch._lock:
        return CompileTotals(_watch.count, _watch.seconds)
