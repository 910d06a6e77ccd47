"""LLMEngine: tokenizer, scheduler, KV cache and model runner, stepped by its owner.

Wiring happens here (the device side is built by worker/build.py).
`add_request` validates (ValueError on bad input, nothing
added); `step` schedules, runs the model once, and returns the requests that progressed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.block_pool import BlockStored, KVCacheEvent
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestId, RequestStatus, choices_of
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import SchedulerOutput
from kvfleet.engine.core.stats import SchedulerStats
from kvfleet.engine.lora.adapter import LoRANotFoundError
from kvfleet.engine.output.processor import OutputProcessor
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.protocol.kv import lora_key
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.structured.grammars import GrammarCompiler
from kvfleet.engine.structured.matchers import ConstrainedRequests
from kvfleet.engine.tokenizer import Tokenizer, tokenize_prompt
from kvfleet.engine.worker.build import build_device_side
from kvfleet.engine.worker.model_runner import LaunchedStep
from kvfleet.engine.worker.setup import resolve_setup

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        setup = resolve_setup(config)
        self.device = setup.device
        self.source = setup.source
        self.model_config = setup.model_config
        self.dtype = setup.dtype
        self.max_model_len = setup.max_model_len
        self.attention_backend = setup.attention_backend
        self.quantization = setup.quantization
        wants_tokenizer = self.source.format != "dummy" or config.tokenizer is not None
        self.tokenizer = (
            Tokenizer.load(self.source, config.tokenizer)
            if wants_tokenizer and not config.skip_tokenizer_init
            else None
        )
        lora = config.lora
        block_size, caching = config.cache.block_size, config.cache.enable_prefix_caching
        self._device = device_side = build_device_side(config, setup)
        self.runner, num_blocks = device_side.runner, device_side.num_blocks
        self.lora, self.speculator = device_side.lora, device_side.speculator
        self.tp, self.workers = device_side.tp, device_side.workers
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, caching, config.enable_kv_events, self.runner.num_swap_blocks
        )
        sched = config.scheduler
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_prefill_seqs=sched.max_prefill_seqs,
            long_prefill_token_threshold=sched.prefill_chunk_cap,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            max_loras=lora.max_loras if lora.enable_lora else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Output constraints: grammars compiled off the step loop, the requests' matchers.
        self.grammars: ConstrainedRequests | None = None
        if self.tokenizer is not None:
            stops = [self.eos_token_id, *self.model_config.eos_token_ids]  # (where complete)
            compiler = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, stops)
            self.grammars = ConstrainedRequests(compiler, self.runner.device)
        self._in_flight: LaunchedStep | None = None  # launched, its outputs not taken yet
        self._broken: str | None = None
        self._penalized: set[str] = set()  # requests whose sampling reads all their outputs
        self._children: dict[str, list[RequestId]] = {}
        self._adapter_of: dict[str, str] = {}  # request id -> its LoRA adapter
        # What the last step scheduled (metrics and tests read it).
        self.last_scheduler_output: SchedulerOutput | None = None
        # Called on the engine thread once each step is scheduled, before it runs (the async
        # engine publishes its stats there: requests are then running, no longer waiting).
        self.on_scheduled: Callable[[], None] | None = None
        logger.info("engine ready: %s", setup.describe(num_blocks, block_size))

    @property
    def block_size(self) -> int:
        return self.kv_cache_manager.block_size

    def stats(self) -> SchedulerStats:
        """The scheduler now, as an immutable record (what other threads may read)."""
        return self.scheduler.stats(
            with_adapters=self.lora is not None, with_spec_decode=self.speculator is not None
        )

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (KV events for gateways)."""
        return self.kv_cache_manager.block_pool.take_events()

    def cached_blocks(self) -> list[BlockStored]:
        return self.kv_cache_manager.block_pool.cached()

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request; ValueError (nothing queued) for a bad prompt or a duplicate id,
        LoRANotFoundError for an adapter name that is not loaded."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.names):
            hint = "" if self.lora is not None else " (this engine runs without enable_lora)"
            raise LoRANotFoundError(f"the adapter {lora_name!r} does not exist{hint}")
        for name, value in (("cache_salt", cache_salt), ("lora_name", lora_name)):
            if value is not None and not _is_unicode(value):
                raise ValueError(f"{name} must be Unicode text (a lone surrogate is not)")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        params.check_token_ids(self.model_config.vocab_size)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = choices_of(
            RequestId(request_id),
            token_ids,
            params,
            self.eos_token_id,
            self.model_config.eos_token_ids,
            arrival,
            priority,
            lora_name,
            cache_salt,
        )
        child_ids = [c.request_id for c in children]
        added: list[RequestId] = []
        try:
            if params.grammar is not None:
                self._constrain(children, params.grammar)
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
            if lora_name is not None and self.lora is not None:
                self.lora.acquire(lora_name)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            if self.grammars is not None:
                self.grammars.remove(*child_ids)
            raise
        if lora_name is not None:
            self._adapter_of[request_id] = lora_name
        self._children[request_id] = child_ids
        if params.has_penalties:
            self._penalized.add(request_id)
        self.output_processor.add_request(request_id, child_ids, text, token_ids, params, arrival)

    def compile_grammar(self, spec: GrammarSpec) -> Future[Any]:
        """Start compiling an output constraint (any thread; the same text compiles once):
        a server waits for it before adding its request, to answer a bad one with 400."""
        if self.grammars is None:
            raise ValueError(
                "an output constraint needs the model's tokenizer, and this engine has none"
            )
        return self.grammars.compiler.submit(spec)

    def _constrain(self, children: list[Request], spec: GrammarSpec) -> None:
        """The children sample under `spec`, waiting in the scheduler until it is compiled."""
        self.compile_grammar(spec)  # (ValueError without a tokenizer)
        assert self.grammars is not None
        ready = self.grammars.add([c.request_id for c in children], spec)
        for child in children:
            child.waits_for_grammar = child.request_id not in ready

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is now compiled may be scheduled; those whose grammar
        cannot compile are aborted (a server checks first: `compile_grammar`)."""
        if not self.grammars:  # (none, or no constrained request)
            return []
        scheduler = self.scheduler
        idle = not scheduler.running and all(r.waits_for_grammar for r in scheduler.waiting)
        return self._fail_children(self.grammars.admit(scheduler.requests, idle))

    def _fail_children(self, reasons: dict[str, str]) -> list[RequestOutput]:
        """Abort the requests of these children, logging why."""
        for child_id, reason in reasons.items():
            logger.error("request %s aborted: %s", child_id, reason)
        parents = [p for p, children in self._children.items() if set(children) & set(reasons)]
        return self.abort_request(parents) if parents else []

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter; LoRAError (400) with the reason if it cannot serve here."""
        if self.lora is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> int:
        """Unload an adapter: new requests can no longer name it, those running finish first.
        Returns how many are still running (0: gone now); LoRANotFoundError if unknown."""
        if self.lora is None:
            raise LoRANotFoundError(f"the adapter {name!r} does not exist")
        running = self.lora.remove(name)
        if not running:
            self._forget_cached_blocks(name)
        return running

    def _request_done(self, request_id: str) -> None:
        children = self._children.pop(request_id, None)
        if self.speculator is not None and children:
            self.speculator.forget(children)
        self._penalized.discard(request_id)
        if self.grammars is not None:
            self.grammars.remove(*(children or []))
        adapter = self._adapter_of.pop(request_id, None)
        if adapter is not None and self.lora is not None and self.lora.release(adapter):
            self._forget_cached_blocks(adapter)

    def _forget_cached_blocks(self, adapter: str) -> None:
        # NOTE: a request's blocks are freed when it finishes, before its output reaches here.
        pool = self.kv_cache_manager.block_pool
        count = pool.forget_cached(lora_key(adapter))
        logger.info("LoRA adapter %r: %d cached blocks dropped", adapter, count)

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        child_ids = [c for rid in request_ids for c in self._children.get(rid, [])]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._request_done(request_id)
        return self.output_processor.abort(child_ids, time.monotonic())

    def recover_from_failed_step(self) -> list[str]:
        """After `step` raised: every request is reset to recompute from the tokens its
        client was given, and the search for the request at fault goes on (one request
        alone failing its step is blamed: `FaultIsolation`). Returns the requests blamed,
        aborted here (their callers tell their clients). EngineSickError when steps fail
        whatever runs in them."""
        self._in_flight = None
        self.runner.forget_requests()
        scheduler = self.scheduler
        if self.speculator is not None:
            self.speculator.forget(list(scheduler.requests))
        done = []
        for child_id, request in scheduler.requests.items():
            delivered = self.output_processor.num_delivered(child_id)
            if delivered is None:  # (a stop string ended it as the step failed)
                done.append(child_id)
            else:
                request.keep_outputs(delivered)
                if self.grammars is not None:
                    self.grammars.keep(child_id, delivered)
        scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
        culprit = scheduler.recover_from_failed_step()
        if culprit is None:
            return []
        parent = next(p for p, children in self._children.items() if culprit in children)
        self.abort_request([parent])
        return [parent]

    def has_unfinished_requests(self) -> bool:
        # NOTE: a step still in flight without them carries no output anyone waits for.
        return self.scheduler.has_unfinished_requests()

    @property
    def fatal_error(self) -> str | None:
        """Why this engine cannot serve any more (a tensor-parallel worker died, steps fail
        whatever runs in them), else None."""
        if self.workers is not None and self.workers.dead is not None:
            return self.workers.dead
        return self._broken

    def mark_broken(self, reason: str) -> None:
        """This engine cannot serve any more (`fatal_error` says why from now on)."""
        self._broken = reason

    def close(self) -> None:
        """Stop the tensor-parallel workers and the grammar threads. Idempotent."""
        if self.grammars is not None:
            self.grammars.close()
        self._device.close()
        self.tp = self._device.tp

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step; the requests it advanced (only those it finished if `final_only`).

        With asynchronous scheduling a step launches the next forward on the device first and
        then returns the outputs of the one before, which ran meanwhile (one step behind)."""
        if self.workers is not None:
            self.workers.check()  # WorkerDiedError: no step can run any more
        outputs: list[RequestOutput] = []
        began = time.monotonic()  # (of what the step costs the engine, for the speculator)
        timed: tuple[int, bool] | None = None  # the timed step: its tokens, whether drafted
        try:
            outputs += self._admit_compiled()
            num_drafts = self._num_drafts()
            if self._in_flight is not None and (num_drafts or not self._may_overlap()):
                outputs += self._finish_step(final_only)  # (drafts follow the latest tokens)
                began = time.monotonic()
            drafts = None
            if num_drafts:
                assert self.speculator is not None
                drafts = self.speculator.propose(self.scheduler.running, num_drafts)
            elif self.speculator is not None:
                self.speculator.shadow(self.scheduler.running)
            scheduler_output = self.scheduler.schedule(drafts)
            self.last_scheduler_output = scheduler_output
            if self.on_scheduled is not None:
                self.on_scheduled()
            now = time.monotonic()
            for new in scheduler_output.scheduled_new_reqs:
                self.output_processor.mark_scheduled(new.req_id, now)
            scheduled = scheduler_output.num_scheduled_tokens
            masks = self.grammars if self.grammars and self.grammars.any_in(scheduled) else None
            launched = self.runner.launch(scheduler_output, hold_sampling=masks is not None)
            if masks is not None:  # (filled once the step before has given its tokens)
                masks.expect(launched.logits_rows)
            if self._in_flight is not None:  # the step before, overlapped with this call
                timed = (self._in_flight.scheduler_output.total_num_scheduled_tokens, False)
                outputs += self._finish_step(final_only)
            if masks is not None:  # (its forward runs while the masks are filled)
                self.runner.sample(launched, masks.bitmask(launched.logits_rows))
            self._in_flight = None if scheduler_output.is_empty else launched
            if self._in_flight is not None and (num_drafts or not self._may_overlap()):
                # (a step drafts were asked for is timed alone, with or without drafts)
                timed = (scheduler_output.total_num_scheduled_tokens, num_drafts > 0)
                outputs += self._finish_step(final_only)
        except BaseException:
            self._in_flight = None  # (its requests are aborted by the caller)
            raise
        if timed is not None and self.speculator is not None:
            num_tokens, drafted = timed
            self.speculator.observe_cost(num_tokens, time.monotonic() - began, drafted)
        return outputs

    def _may_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's outputs are taken."""
        return self.config.scheduler.async_scheduling and not self._penalized

    def _num_drafts(self) -> int:
        """Drafts per decoding request for the next step (0: none, or no speculation)."""
        if self.speculator is None:
            return 0
        return self.speculator.num_drafts(self.scheduler.num_running)

    def _finish_step(self, final_only: bool) -> list[RequestOutput]:
        """Take the outputs of the step in flight: token stops, detokenizing, stop strings."""
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        runner_output = self.runner.collect(launched)
        scheduler_output = launched.scheduler_output
        failed = (
            self._fail_children(
                self.grammars.advance(
                    runner_output.req_ids,
                    runner_output.sampled_token_ids,
                    self.scheduler.requests,
                )
            )
            if self.grammars is not None
            else []
        )
        stats = self.scheduler.spec_decode_stats
        accepted, rejections = stats.num_accepted_tokens, stats.num_rejections
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.speculator is not None:
            self.speculator.observe(
                stats.num_accepted_tokens - accepted, stats.num_rejections - rejections
            )
        now = time.monotonic()
        outputs, stopped = self.output_processor.process(core_outputs, now, final_only)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.isolation.step_passed(o.req_id for o in core_outputs if o.new_token_ids)
        for output in outputs:
            if output.finished:
                self._request_done(output.request_id)
        return failed + outputs


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes to UTF-8 (what block hashing does with it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
