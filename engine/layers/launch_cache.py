"""Triton launches that skip Triton's Python launcher when only the tensors' addresses changed.

`kernel[grid](...)` binds every argument, specializes each (dtype, 16-byte alignment, ints
equal to 1 or divisible by 16), builds a cache key and looks the compiled kernel up before
it launches: ~25-40 us of host time a launch on the device's host, more than the C launch
itself. Between the prefill graph pieces a step launches the attention kernels eagerly, two a
layer with the same sizes and scalars in every layer: a prefix hit's step (32 new tokens, an
8B model) spent 4.7 ms of host time in its graph pieces and their attention (3.5 with this
cache, H200, bench/RESULTS.md session 22) beside ~5.5 ms of GPU work.

`CachedKernel(kernel)[grid](...)` takes the same arguments. It keys a launch on the grid, the
keyword arguments (constexprs and launch options), every argument's type, each tensor's dtype,
device and whether its address is 16-byte aligned, and every other argument's value — at least
what Triton specializes on — and replays the compiled kernel Triton returned for the first
launch with that key through its own runner (`CompiledKernel[grid](*args)`, the same C
launcher). A key seen once costs one Triton launch; a new key (a new size, scalar or
alignment) launches through Triton again. Under the interpreter (no compiled kernel) every
launch goes through Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from triton.compiler import CompiledKernel

# Distinct launches kept per kernel before the cache starts again (a step's sizes make new
# keys; steps repeat sizes often, and a miss only costs the launch Triton would have done).
MAX_VARIANTS = 256


def _key_of(arg: Any) -> Hashable:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.device, arg.data_ptr() % 16 == 0
    key: Hashable = arg
    return key


class CachedKernel:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.runners: dict[Hashable, Callable[..., None]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launch(grid, args, kwargs)

        return launch

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # (the types too: True == 1 == 1.0, which Triton compiles as different arguments)
        key = (grid, tuple(kwargs.items()), *map(type, args), *map(_key_of, args))
        runner = self.runners.get(key)
        if runner is not None:
            runner(*args)
            return
        compiled = self.kernel[grid](*args, **kwargs)
        if not isinstance(compiled, CompiledKernel):  # (the interpreter: nothing to replay)
            return
        if len(self.runners) >= MAX_VARIANTS:
            self.runners.clear()
        self.runners[key] = self._runner(compiled, grid, len(args), kwargs)

    def _runner(
        self, compiled: CompiledKernel, grid: tuple[int, ...], num_args: int, kwargs: dict[str, Any]
    ) -> Callable[..., None]:
        """Launches `compiled` over `grid` given the positional arguments: the parameters
        after them (constexprs) are the keyword arguments' values, or their defaults."""
        tail = tuple(kwargs.get(p.name, p.default) for p in self.kernel.params[num_args:])
        run = compiled[(*grid, *(1,) * (3 - len(grid)))]

        def runner(*args: Any) -> None:
            run(*args, *tail)

        return runner
