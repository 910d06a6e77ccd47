"""Triton kernels compiled once the engine serves. The warm-up compiles the variants steps use;
a variant it missed is compiled at its first launch, and that step (with every request in it)
waits for the compile: 0.2-1.2 s on an H100, a p99 spike that looks like the GPU's work.
`CompileWatch` logs each such compile with the variant's specialization and counts it
(`kvfleet:kernel_compiles_while_serving_total`); the GPU tests assert it sees none.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

# Names kept for tests and the log (the count goes on past them).
_KEPT_NAMES = 64


class CompileWatch:
    """From `start` to `stop`, every Triton JIT compile in this process (Triton's
    `jit_cache_hook`, called before each compile; whatever hook was set before is called too)."""

    def __init__(self) -> None:
        self.count = 0
        self.compiled: list[str] = []  # the first _KEPT_NAMES kernels' names
        self._lock = threading.Lock()
        self._previous: Any = None
        self._watching = False

    def start(self) -> bool:
        """Watch from now on; False where this Triton has no compile hook (nothing watched)."""
        try:
            from triton import knobs
        except ImportError:  # (no Triton, or one before knobs: 3.3 and older)
            return False
        if not self._watching:
            self._previous = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._compiling
            self._watching = True
        return True

    def stop(self) -> None:
        if self._watching:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._previous
            self._watching = False

    def _compiling(self, **hook: Any) -> bool:
        """Triton's hook: returning False lets the compile go on."""
        fn = hook["fn"]
        name = fn.name
        names = getattr(fn.jit_function, "arg_names", [])
        constants = {  # (keyed by argument paths: a top-level argument's is its index alone)
            names[path[0]] if len(path) == 1 and path[0] < len(names) else path: value
            for path, value in hook.get("compile", {}).get("constants", {}).items()
        }
        with self._lock:
            self.count += 1
            if len(self.compiled) < _KEPT_NAMES:
                self.compiled.append(name)
        logger.warning(
            "Triton is compiling %s while serving (%s): the step launching it waits for the "
            "compile; the warm-up missed this variant",
            name,
            ", ".join(f"{k}={v}" for k, v in constants.items()),
        )
        previous = self._previous
        return bool(previous(**hook)) if previous is not None else False


# The engine process's watch (one engine a process), started once the engine is ready.
WHILE_SERVING = CompileWatch()
