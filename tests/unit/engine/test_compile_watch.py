"""CompileWatch (engine/layers/compile_watch.py): Triton compiles after the warm-up are logged
with the variant and counted (scraped: test_engine_metrics.py); Triton's hook is taken and given
back. (On a GPU, tests/gpu/test_engine_cuda.py's serving steps run under it and must meet no
compile.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvfleet.engine.layers.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


def _compile_of(name: str, arg_names: list[str], constants: dict[Any, Any]) -> dict[str, Any]:
    """The keywords Triton's `jit_cache_hook` gets before it compiles `name`."""
    fn = SimpleNamespace(name=name, jit_function=SimpleNamespace(arg_names=arg_names))
    return {"key": ("k",), "repr": name, "fn": fn, "compile": {"constants": constants}}


def test_a_compile_while_watched_is_logged_counted_and_passed_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved = knobs.runtime.jit_cache_hook  # (a server started by another test may watch)
    before: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **hook: before.append(hook["fn"].name) or False
    watch = CompileWatch()
    try:
        assert watch.start()
        hook = knobs.runtime.jit_cache_hook
        assert hook is not None
        with caplog.at_level(logging.WARNING, "kvfleet.engine.layers.compile_watch"):
            compiled = _compile_of("_decode_kernel", ["q", "k", "SPLIT", "BLOCK"], {(2,): 4})
            assert hook(**compiled) is False  # (the compile goes on)
        assert watch.count == 1
        assert watch.compiled == ["_decode_kernel"]
        assert before == ["_decode_kernel"]  # the hook set before still sees it
        (record,) = caplog.records
        assert "_decode_kernel while serving (SPLIT=4)" in record.getMessage()
        watch.stop()
        assert knobs.runtime.jit_cache_hook is not hook  # given back
        assert knobs.runtime.jit_cache_hook is not None
    finally:
        watch.stop()
        knobs.runtime.jit_cache_hook = saved


def test_nothing_is_counted_outside_start_and_stop() -> None:
    watch = CompileWatch()
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = None
    assert watch.start()
    assert watch.start()
    hook = knobs.runtime.jit_cache_hook
    assert hook is not None
    hook(**_compile_of("_gemv", ["x"], {}))
    watch.stop()
    assert knobs.runtime.jit_cache_hook is None
    knobs.runtime.jit_cache_hook = saved
    assert watch.count == 1
