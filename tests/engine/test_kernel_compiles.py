"""The kernel-compile watch, driven the way Triton drives its JIT hooks (this machine has no GPU to compile for)."""

import logging
import types

import pytest
from triton import knobs

from m3stack.engine import kernel_compiles


@pytest.fixture
def fresh_watch(monkeypatch):
    """An uninstalled watch over hooks someone else set before it (restored afterwards)."""
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(kernel_compiles, "_watch", kernel_compiles._Watch())
    monkeypatch.setattr(kernel_compiles, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("before", kw)))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("after", kw)))
    return calls


class _Fn:
    name = "_scan_kernel"


def _hook_kwargs(key: str, aligned: tuple[int, ...] = (0,)) -> dict:
    """What Triton passes: the signature by argument name, the constexprs and the attributes by argument path."""
    signature = {"keys": "*bf16", "page_ids": "*i32", "num_pages": "i32", "SP": "constexpr", "STORE": "constexpr"}
    attributes = {(index,): [["tt.divisibility", 16]] if index in aligned else [] for index in range(3)}
    compile_info = {"signature": signature, "constants": {("SP",): 64, ("STORE",): False}, "configs": [attributes]}
    return dict(key=key, repr="r", fn=_Fn(), compile=compile_info, is_manual_warmup=False, already_compiled=False)


def test_compiles_are_counted_timed_logged_and_earlier_hooks_still_called(fresh_watch, caplog):
    assert kernel_compiles.watch() and kernel_compiles.watch()  # the second call installs nothing more
    assert kernel_compiles.snapshot() == kernel_compiles.CompileTotals(0, 0.0)
    with caplog.at_level(logging.INFO, logger=kernel_compiles.__name__):
        for key in ("a", "b"):
            assert knobs.runtime.jit_cache_hook(**_hook_kwargs(key)) is None  # None: Triton goes on to compile
            knobs.runtime.jit_post_compile_hook(**_hook_kwargs(key))
    totals = kernel_compiles.snapshot()
    assert totals.count == 2 and totals.seconds >= 0.0
    assert [phase for phase, _ in fresh_watch] == ["before", "after", "before", "after"]
    assert [kw["key"] for _, kw in fresh_watch] == ["a", "a", "b", "b"]
    assert "compiled _scan_kernel" in caplog.text and "SP=64, STORE=False; 16-aligned: keys" in caplog.text


def test_the_log_names_the_argument_whose_class_changed(fresh_watch, caplog):
    """Equal constexprs, another specialization: a page table at an odd offset and a count off a multiple of 16."""
    kernel_compiles.watch()
    with caplog.at_level(logging.INFO, logger=kernel_compiles.__name__):
        knobs.runtime.jit_post_compile_hook(**_hook_kwargs("a", aligned=(0, 1, 2)))
        knobs.runtime.jit_post_compile_hook(**_hook_kwargs("b", aligned=(0,)))
    first, second = (r.getMessage() for r in caplog.records)
    assert first.endswith("16-aligned: keys, page_ids, num_pages)")
    assert second.endswith("16-aligned: keys)")


def test_a_triton_without_jit_hooks_is_reported(fresh_watch, monkeypatch):
    monkeypatch.setattr(knobs, "runtime", types.SimpleNamespace(jit_cache_hook=None))  # an older Triton
    assert kernel_compiles.watch() is False
    assert kernel_compiles.snapshot().count == 0
