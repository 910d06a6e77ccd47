"""The CPU work on a request body (parsing, validation, templating, tokenizing), kept off the
event loop and out of the engine's way (`BodyWork`).

Light on purpose (no engine imports): the gateway uses it too.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

from kvfleet.engine.protocol.http import APIError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Tok = TypeVar("_Tok")

# From this size a body is worked on in a worker process, not a thread.
LARGE_BODY_BYTES = 128 << 10
# Large bodies waiting for or in the worker at once; more are refused (503) at once, so a
# flood of them holds a bounded amount of memory and delay.
MAX_LARGE_BODIES = 16


class BodyWork(Generic[_Tok]):
    """Where the CPU work on request bodies runs: a worker thread for small ones, a worker
    process for large ones. In a thread, pure-Python work (validation, chat templates) holds
    the GIL between the engine thread's kernels, 5 ms at a time (a 4 MB body of 100,000
    messages slowed a CPU engine's steps from 70 ms to over a second), and building its
    objects sets off the garbage collector's full passes; a process shares neither.

    `work(tokenizer, *args)` is a module-level function with picklable arguments and result;
    `tokenizer` is this process's (in a thread) or the worker's, made once by `load` (a
    picklable callable; None: no tokenizer)."""

    def __init__(
        self, tokenizer: _Tok | None, load: Callable[[], _Tok] | None, prestart: bool = False
    ) -> None:
        """`prestart`: start the worker process now (and again with each new tokenizer), so
        the first large body does not pay its start-up, seconds of CPU beside the engine."""
        self.tokenizer = tokenizer
        self._load = load
        self._prestart = prestart
        self._pool: ProcessPoolExecutor | None = None
        self._large = 0  # large bodies waiting for or in the worker
        if prestart:
            self._executor().submit(_in_worker, _nothing)

    def use(self, tokenizer: _Tok | None, load: Callable[[], _Tok] | None) -> None:
        """Another tokenizer from now on (the worker process starts again with it)."""
        self.tokenizer, self._load = tokenizer, load
        self.close()
        if self._prestart:
            self._executor().submit(_in_worker, _nothing)

    async def run(self, size: int, work: Callable[..., _T], *args: Any) -> _T:
        """`work(tokenizer, *args)` off the event loop; `size`: the body's bytes."""
        if size < LARGE_BODY_BYTES:
            return await asyncio.to_thread(work, self.tokenizer, *args)
        if self._large >= MAX_LARGE_BODIES:
            raise APIError(
                503,
                f"{self._large} large request bodies are being read; retry shortly",
                "service_unavailable",
                "overloaded",
            )
        self._large += 1
        try:
            return await asyncio.wrap_future(self._executor().submit(_in_worker, work, *args))
        except BrokenProcessPool as exc:
            logger.error("the request worker process died; starting another for the next body")
            self._pool = None
            raise APIError(
                503, "the worker reading this request died; retry", "service_unavailable"
            ) from exc
        finally:
            self._large -= 1

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                1,
                # (forked from a clean server process, never from this one: no threads, no
                # CUDA state; and not one of this process's own children, as its
                # tensor-parallel ranks are)
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=_start_worker,
                initargs=(self._load,),
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_worker: dict[str, Any] = {}  # (in a worker process: its tokenizer, made by its `load`)


def _start_worker(load: Callable[[], Any] | None) -> None:
    # Reading a body yields the CPU to the engine's steps (streams) and the event loop.
    os.nice(10)
    _worker["tokenizer"] = load() if load is not None else None


def _in_worker(work: Callable[..., _T], *args: Any) -> _T:
    return work(_worker["tokenizer"], *args)


def _nothing(_: Any) -> None:
    """The first task of a worker started ahead of need."""
