"""Ranks 1..N-1 of a tensor-parallel engine: separate processes the engine (rank 0) starts,
watches, and stops.

A worker builds its shard of the model exactly as rank 0 does (same config, same order of
collectives), then runs each step rank 0 broadcasts until told to stop. If a worker dies, rank
0 learns it at once through the process sentinel and fails loudly; a worker whose rank 0 is gone
fails its next collective and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited: the engine cannot go on."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerPool:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, config: Any, world_size: int, port: int) -> None:
        self.config = config
        self.world_size = world_size
        self.port = port
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.dead: str | None = None  # why the engine cannot go on, once a worker died
        self._stopping = threading.Event()
        self._on_death: list[Callable[[str], None]] = []

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no forked CUDA or thread state
        with _main_not_reimported():
            for rank in range(1, self.world_size):
                process = context.Process(
                    target=worker_main,
                    args=(self.config, rank, self.world_size, self.port),
                    name=f"kvfleet-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes.append(process)
        # At interpreter exit multiprocessing terminates the (daemon) workers: not deaths.
        # (atexit runs last registered first: this one before multiprocessing's.)
        atexit.register(self.expect_exit)
        threading.Thread(target=self._watch, name="kvfleet-tp-watch", daemon=True).start()

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._on_death.append(callback)

    def check(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def run_while_alive(self, work: Callable[[], T]) -> T:
        """`work()` (a step every rank must join, e.g. the rendezvous), abandoned with
        WorkerDiedError as soon as a worker dies instead of waiting for a collective's timeout."""
        result: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(work())
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run, name="kvfleet-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            self.check()
        if failure:
            raise failure[0]
        return result[0]

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank, process = sentinels[ready[0]]  # type: ignore[index]
        process.join(1)
        self.dead = (
            f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}; the engine cannot continue without it"
        )
        logger.critical(self.dead)
        for callback in self._on_death:
            callback(self.dead)

    def expect_exit(self) -> None:
        """The workers are being told to stop: their exits are no longer deaths."""
        self._stopping.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Workers started meanwhile do not run the user's script again. A spawned child imports
    the parent's `__main__` (by its module name, else its file) before its target: a script
    that builds an `LLM` at its top level, without an `if __name__ == "__main__":` guard,
    would start a second engine in every worker. Their target and arguments live in kvfleet,
    so nothing of `__main__` is needed there."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        n: main.__dict__[n] for n in ("__spec__", "__file__") if n in main.__dict__
    }
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def worker_main(config: Any, rank: int, world_size: int, port: int) -> None:
    """The body of a worker process."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s tp-rank{rank} %(name)s: %(message)s"
    )
    from kvfleet.engine.worker.setup import build_rank, freeze_startup_heap

    faulthandler.enable()  # a hung or crashed rank shows where (SIGABRT, SIGSEGV)
    try:
        runner, tp = build_rank(config, rank, world_size, port)
        freeze_startup_heap()
        runner.serve_steps(tp)
        runner.release_graphs()
        tp.close()
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    logger.info("tensor-parallel rank %d stopped", rank)
    os._exit(0)
