"""AsyncEngine: an LLMEngine stepped in one background thread, one async stream per request.

The engine is touched only by its thread. Callers talk to it through a command queue (add,
abort, KV snapshot) and get outputs back on per-request asyncio queues. A step that raises is
recovered from: the engine searches for the request at fault (`FaultIsolation`) and fails only
that one (RequestFailedError); the others go on. Only an engine that cannot go on (a dead
tensor-parallel worker, steps failing whatever runs in them) fails everything in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.core.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvfleet.engine.core.stats import SchedulerStats
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.protocol.kv import KVEvent, KVSnapshot, adapter_of
from kvfleet.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop is not running; nothing can be served."""


class EngineStepError(RuntimeError):
    """The engine stopped for good while this request was in flight (its own fault)."""


class RequestFailedError(RuntimeError):
    """This request made the engine's steps fail (found by running them without it); it
    alone was stopped."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


@dataclass
class _KVSubscriber:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[KVEvent] = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None
    ):
        self.engine = engine
        self.on_finished = on_finished
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._kv_subscribers: list[_KVSubscriber] = []
        self._kv_seq = 0
        # Requests handed to the engine thread but not yet in its scheduler (a step is running).
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self.num_step_errors = 0
        self.num_isolated = 0  # requests failed alone for making steps fail
        if engine.workers is not None:  # a dying worker wakes the loop, which then stops
            engine.workers.on_death(lambda _: self._wake.set())
        self._lora_names: tuple[str, ...] = ()
        self._refresh_lora_names()
        # The scheduler as the engine thread last saw it: each turn of the loop, after handing
        # it requests (and so right after a step's outputs), and once each step is scheduled
        # (other threads read only this).
        self.stats: SchedulerStats = engine.stats()
        engine.on_scheduled = self._publish_stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine stopped for good (a tensor-parallel worker died), else None."""
        return self.engine.fatal_error

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests waiting: in the scheduler's queue, or not yet handed to it."""
        return self.stats.num_waiting + self._pending_adds

    def start(self) -> None:
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; ValueError (raised here, before any output) for bad input (a
        grammar that does not compile among it), LoRANotFoundError for an adapter that is not
        loaded. `arrival_time` (time.monotonic()): when the request reached the server, which
        its queue time and TTFT count from (default: when the engine thread takes it, after
        the step then running).
        Leaving the returned iterator early aborts the request."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if params.grammar is not None:  # (compiled off the loop; a bad one raises here)
            await asyncio.wrap_future(self.engine.compile_grammar(params.grammar))
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        accepted: asyncio.Future[None] = loop.create_future()
        self._streams[request_id] = stream
        with self._pending_lock:
            self._pending_adds += 1
        request = (request_id, prompt, params, priority, cache_salt, lora_name, arrival_time)
        self._submit("add", (*request, loop, accepted))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._iterate(request_id, stream)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    async def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter in the engine thread; LoRAError with the reason if it cannot."""
        await self._call(lambda: self.engine.add_lora(name, path))

    async def remove_lora(self, name: str) -> int:
        """Unload an adapter; how many running requests finish with it first."""
        result: int = await self._call(lambda: self.engine.remove_lora(name))
        return result

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The adapters requests may name (a snapshot the engine thread keeps current)."""
        return self._lora_names

    async def _call(self, work: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._submit("call", (work, loop, done))
        return await done

    async def kv_snapshot_and_subscribe(self) -> tuple[KVSnapshot, _KVSubscriber]:
        """The cached blocks now, and a subscription to every event after them (atomic)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[KVSnapshot, _KVSubscriber]] = loop.create_future()
        self._submit("kv_subscribe", (loop, done))
        return await done

    def kv_unsubscribe(self, subscriber: _KVSubscriber) -> None:
        self._submit("kv_unsubscribe", subscriber)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Let in-flight requests finish for up to `timeout_s`, then abort the rest and stop."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)
        await asyncio.to_thread(self.engine.close)

    # --- the engine thread -------------------------------------------------------------

    def _submit(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        logger.info("engine loop started")
        while not self._stop.is_set():
            self._handle_commands()
            self._publish_stats()
            if self.engine.fatal_error is not None:
                logger.critical("the engine cannot go on: %s", self.engine.fatal_error)
                self._fail_in_flight(RuntimeError(self.engine.fatal_error))
                break
            if not self.engine.has_unfinished_requests():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                self._recover(exc)
                continue
            for output in outputs:
                self._deliver(output)
            if any(o.finished for o in outputs):
                self._refresh_lora_names()  # an unloaded adapter's last request may be done
            self._publish_kv_events(self.engine.take_kv_events())
        self._stop.set()
        self._handle_commands()
        logger.info("engine loop stopped")

    def _handle_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                for output in self.engine.abort_request([payload]):
                    self._deliver(output)
            elif kind == "call":
                work, loop, done = payload
                try:
                    result = work()
                except Exception as exc:  # the caller gets it; the loop goes on
                    loop.call_soon_threadsafe(_fail, done, exc)
                else:
                    loop.call_soon_threadsafe(_resolve, done, result)
                self._refresh_lora_names()
            elif kind == "kv_subscribe":
                loop, done = payload
                subscriber = _KVSubscriber(loop)
                self._kv_subscribers.append(subscriber)
                snapshot = self._kv_snapshot()
                loop.call_soon_threadsafe(_resolve, done, (snapshot, subscriber))
            elif kind == "kv_unsubscribe" and payload in self._kv_subscribers:
                self._kv_subscribers.remove(payload)

    def _add(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        lora_name: str | None,
        arrival_time: float | None,
        loop: asyncio.AbstractEventLoop,
        accepted: asyncio.Future[None],
    ) -> None:
        with self._pending_lock:
            self._pending_adds -= 1
        if request_id not in self._streams:  # the caller went away before we got here
            return
        try:
            self.engine.add_request(
                request_id,
                prompt,
                params,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
                arrival_time=arrival_time,
            )
        except ValueError as exc:
            loop.call_soon_threadsafe(_fail, accepted, exc)
            return
        loop.call_soon_threadsafe(_resolve, accepted, None)

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()

    def _refresh_lora_names(self) -> None:
        lora = self.engine.lora
        self._lora_names = tuple(lora.names) if lora is not None else ()

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished and self.on_finished is not None:
            self.on_finished(output)
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _recover(self, exc: Exception) -> None:
        """A step raised: find the request at fault and fail it alone, or, when the engine
        itself is broken, stop."""
        self.num_step_errors += 1
        if self.engine.fatal_error is None:
            try:
                blamed = self.engine.recover_from_failed_step()
            except Exception as fault:  # (EngineSickError among them)
                logger.critical("an engine step failed and the engine cannot go on: %s", fault)
                self.engine.mark_broken(f"{exc}; recovering failed: {fault}")
            else:
                logger.error(
                    "an engine step failed; requests blamed: %s",
                    blamed or "none yet",
                    exc_info=exc,
                )
                self.num_isolated += len(blamed)
                for request_id in blamed:
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        message = f"this request made the engine fail, and was stopped: {exc}"
                        stream.put(RequestFailedError(message))
                self._publish_kv_events(self.engine.take_kv_events())
                return
        self._fail_in_flight(exc)
        self._stop.set()

    def _fail_in_flight(self, exc: Exception) -> None:
        logger.error("the engine stopped; failing the %d requests in flight", len(self._streams))
        request_ids = list(self._streams)
        try:
            self.engine.abort_request(request_ids)
        except Exception:  # the engine state itself is broken: nothing more can be served
            logger.exception("aborting after a failed step failed too; stopping the engine loop")
            self._stop.set()
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(EngineStepError(f"the engine failed while serving this request: {exc}"))

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _kv_snapshot(self) -> KVSnapshot:
        blocks = [_kv_event(self._kv_seq, stored) for stored in self.engine.cached_blocks()]
        return KVSnapshot(seq=self._kv_seq, block_size=self.engine.block_size, blocks=blocks)

    def _publish_kv_events(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            self._kv_seq += 1
            message = _kv_event(self._kv_seq, event)
            for subscriber in self._kv_subscribers:
                subscriber.loop.call_soon_threadsafe(subscriber.events.put_nowait, message)


def _kv_event(seq: int, event: KVCacheEvent) -> KVEvent:
    if isinstance(event, BlockStored):
        adapter = adapter_of(event.extra_keys)
        return KVEvent(
            seq=seq,
            type="stored",
            block_hash=event.block_hash.hex(),
            parent_hash=event.parent_hash.hex(),
            token_count=len(event.token_ids),
            adapter=adapter,
        )
    if isinstance(event, BlockRemoved):
        return KVEvent(seq=seq, type="removed", block_hash=event.block_hash.hex())
    assert isinstance(event, AllBlocksCleared)
    return KVEvent(seq=seq, type="cleared")


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
