"""Scheduler: which requests compute how many tokens each step, under one token budget.

No prefill or decode phases: every request has `num_computed_tokens` chasing `num_tokens`, so a
long prompt spreads over steps (chunked prefill) while running requests keep decoding. Running
requests go first, in priority order; then waiting ones, by priority, then arrival. When blocks
run out, the lowest-priority, newest running request is preempted: its blocks swapped out to
host memory where it has room (copied back when it resumes), else freed (recomputed later).

Which waiting requests may start, and how much of a step a prompt may take: admission.py.

`num_computed_tokens` advances when a step is scheduled, so the next step can be scheduled
before this one's output arrives (asynchronous scheduling): a request whose step samples a token
holds it as pending and may decode it next step, its id filled in on the device.

Speculative decoding: a decoding request may come with draft tokens (`schedule(drafts)`); it
then computes its last token and the drafts in one step, and samples after each. Drafts are
cut to what max_tokens, max_model_len and the budget leave room for. When the output comes
back, `num_computed_tokens` falls back by the drafts rejected (their KV slots are rewritten
by the tokens that replace them). A step that carries drafts must be taken before the next
is scheduled.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping

from kvfleet.engine.core.admission import AdmissionPolicy
from kvfleet.engine.core.isolation import FaultIsolation
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestId, RequestStatus
from kvfleet.engine.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvfleet.engine.core.stats import SchedulerStats, SpecDecodeStats, read_stats


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
        max_prefill_seqs: int | None = None,
        long_prefill_token_threshold: int | None = None,
    ) -> None:
        """`max_prefill_seqs`: at most this many requests compute prompt tokens (their own, or
        recomputed after preemption) in one step; None: as many as the budget holds.
        `max_loras`, `long_prefill_token_threshold`: `AdmissionPolicy`'s."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2:
            raise ValueError(
                "max_num_batched_tokens and max_num_seqs must be at least 1 and max_model_len "
                f"at least 2, got {max_num_batched_tokens}, {max_num_seqs}, {max_model_len}"
            )
        if max_prefill_seqs is not None and max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs must be at least 1, got {max_prefill_seqs}")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must "
                f"be at least max_model_len ({max_model_len}) so every prompt fits in one step"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_prefill_seqs = max_prefill_seqs
        self.admission = AdmissionPolicy(
            kv_cache_manager,
            max_model_len,
            long_prefill_token_threshold,
            enable_chunked_prefill,
            max_loras,
        )
        self.requests: dict[RequestId, Request] = {}
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swapped = 0  # of which swapped out (the rest recomputed)
        self._arrival_order: dict[RequestId, int] = {}
        self._counter = itertools.count()
        self._finished_since_last_step: set[RequestId] = set()
        self.spec_decode_stats = SpecDecodeStats()
        self.isolation = FaultIsolation()
        # The request `schedule` is at while it runs (None once it returns): a failure while
        # scheduling is that request's, most likely.
        self._scheduling: RequestId | None = None

    def stats(self, with_adapters: bool = False, with_spec_decode: bool = False) -> SchedulerStats:
        """A reading of the scheduler now (on the engine thread, for the others)."""
        spec = self.spec_decode_stats if with_spec_decode else None
        kv, running, waiting = self.kv_cache_manager, self.running, self.waiting
        preemptions = (self.num_preemptions, self.num_swapped)
        return read_stats(kv, running, waiting, preemptions, spec, with_adapters)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: at least one token is needed")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len}, which leaves no room for an output token"
            )
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._counter)
        self._enqueue(request)

    def finish_requests(self, request_ids: Iterable[RequestId], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string); unknown ids are ignored."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def recover_from_failed_step(self) -> RequestId | None:
        """A step raised: every request goes back to waiting, to recompute from its tokens
        (no pending ones: no step is in flight now), on a KV cache with nothing in it; the
        search for the request at fault goes on (`FaultIsolation`). Returns the request
        blamed, if known now (still queued: the caller finishes it)."""
        in_step = {r.request_id for r in self.running}
        scheduling, self._scheduling = self._scheduling, None
        for request in self.running:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self._enqueue(request)
        self.running = []
        for request in self.waiting:  # (swapped-out ones too: their host blocks are dropped)
            request.num_pending_tokens = request.num_computed_tokens = 0
        self.kv_cache_manager.reset()
        self._finished_since_last_step = set()
        waiting = [r.request_id for r in self.waiting]
        return self.isolation.step_failed(waiting, in_step, scheduling)

    def schedule(self, drafts: Mapping[RequestId, list[int]] | None = None) -> SchedulerOutput:
        """The next step. `drafts`: draft tokens proposed for running requests (speculative
        decoding), used where the request is decoding and there is room."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[RequestId, int] = {}
        cached_reqs: list[CachedRequestData] = []
        preempted: set[RequestId] = set()
        scheduled_drafts: dict[RequestId, list[int]] = {}
        num_prefills = 0  # requests computing prompt tokens this step

        self.running.sort(key=self._queue_key)
        # NOTE: while requests wait to start, no prompt takes more than the cap of a step
        may_admit = bool(self.waiting) and len(self.running) < self.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            self._scheduling = request.request_id
            proposed = drafts.get(request.request_id) if drafts else None
            spec = request.drafts_that_fit(proposed, budget, self.max_model_len) if proposed else []
            cap = self.admission.prompt_cap(may_admit, budget, len(self.running) - i - 1)
            num_new = self.admission.tokens_to_schedule(
                request, budget, num_drafts=len(spec), cap=cap
            )
            if num_new == 0:
                i += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()  # the lowest priority, newest
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            num_prefills += num_new - len(spec) > 1  # (a decode computes one token)
            if spec:
                scheduled_drafts[request.request_id] = spec
            cached_reqs.append(
                CachedRequestData(
                    request.request_id,
                    [b.block_id for b in new_blocks],
                    request.num_computed_tokens,
                )
            )
            self._advance(request, num_new, len(spec))
            budget -= num_new
            i += 1

        # NOTE: no admissions in a step that preempted: the freed blocks go to running requests.
        new_reqs: list[NewRequestData] = []
        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, new_reqs, num_prefills)

        finished = self._finished_since_last_step | preempted
        self._finished_since_last_step = set()
        self._scheduling = None
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=scheduled_drafts,
            swaps=self.kv_cache_manager.take_swaps(),
        )

    def _admit_waiting(
        self,
        budget: int,
        num_scheduled: dict[RequestId, int],
        new_reqs: list[NewRequestData],
        num_prefills: int,
    ) -> int:
        """Start waiting requests in queue order while the budget, seats, prefill slots and
        blocks last (`AdmissionPolicy`); returns the budget left."""
        max_prefills = self.max_prefill_seqs or self.max_num_seqs
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return budget  # (the common decode step: no walk over the running requests)
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        reserved = sum(self.admission.blocks_to_end(r) for r in self.running)
        position = 0
        while position < len(self.waiting) and budget > 0:
            if len(self.running) >= self.max_num_seqs or num_prefills >= max_prefills:
                break
            request = self.waiting[position]
            # NOTE: a request preempted while its last step ran waits for that step's token.
            if (
                request.num_pending_tokens
                or request.waits_for_grammar
                or not self.admission.adapter_fits(request, adapters)
                or not self.isolation.may_start(request.request_id)
            ):
                position += 1  # waits for a slot; requests behind it may still start
                continue
            self._scheduling = request.request_id
            kv = self.kv_cache_manager
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            # (a swapped-out request's computed tokens are in host blocks: copied back)
            start = max(request.num_computed_tokens, num_hit_tokens)
            cap = self.admission.prompt_cap(position + 1 < len(self.waiting))
            num_new = self.admission.tokens_to_schedule(request, budget, num_hit_tokens, cap=cap)
            if num_new == 0:
                break
            if not self.admission.can_start(
                request, hits, start + num_new, reserved, idle=not self.running
            ):
                break
            if kv.is_swapped_out(request) and start > num_hit_tokens:
                new_blocks = kv.allocate_swapped(request, num_new, hits)
            else:  # (a swapped-out request whose prefix hits hold all it had: no copy back)
                kv.drop_swapped(request)
                request.num_computed_tokens = 0
                new_blocks = kv.allocate_slots(request, num_new, hits)
            if new_blocks is None:
                break
            self.waiting.pop(position)
            if request.lora_name is not None:
                adapters.add(request.lora_name)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = start
            if request.num_cached_tokens is None:  # (its first start)
                request.num_cached_tokens = num_hit_tokens
                self.kv_cache_manager.record_prefix_query(request.num_tokens, num_hit_tokens)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.sampling_params,
                    self.kv_cache_manager.get_block_ids(request.request_id),
                    start,
                    request.lora_name,
                )
            )
            self._advance(request, num_new)
            reserved += self.admission.blocks_to_end(request)
            budget -= num_new
            num_prefills += 1
        return budget

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Take each scheduled request's sampled tokens (those of a request preempted since the
        step was scheduled too); apply the token stops; roll back rejected drafts."""
        index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        spec = scheduler_output.scheduled_spec_decode_tokens
        outputs = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            i = index.get(req_id)
            if request is None or i is None or not runner_output.sampled_token_ids[i]:
                continue  # finished (aborted, stopped) while the step ran, or a prompt chunk
            sampled = runner_output.sampled_token_ids[i]
            logprobs = runner_output.logprobs[i]
            request.num_pending_tokens -= 1
            if req_id in spec:
                self._take_verdict(request, len(spec[req_id]), len(sampled) - 1)
            new_token_ids: list[int] = []
            status = None
            for token_id in sampled:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = request.stop_status(token_id, self.max_model_len)
                if status is not None:
                    break
            if status is not None:
                queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
                queue.remove(request)
                self._finish(request, status)
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs[: len(new_token_ids)] if logprobs else None,
                    finish_reason=status.finish_reason if status else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                )
            )
        return outputs

    def _take_verdict(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A drafted step's outcome: the rejected drafts' tokens are to compute again."""
        request.num_computed_tokens -= num_drafts - num_accepted
        stats = self.spec_decode_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        stats.num_rejections += num_accepted < num_drafts

    def _advance(self, request: Request, num_new: int, num_drafts: int = 0) -> None:
        """`num_new` tokens scheduled: a step that reaches the last input (the last draft, if
        any) samples one more (and with drafts maybe several: counted when they arrive)."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens + (
            num_drafts
        ):
            request.num_pending_tokens += 1

    def _preempt(self, request: Request) -> None:
        swapped = self.kv_cache_manager.swap_out(request)  # (its computed tokens kept)
        if not swapped:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_swapped += swapped
        self._enqueue(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._arrival_order[request.request_id]
        self._finished_since_last_step.add(request.request_id)
        self.isolation.forget([request.request_id])

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._queue_key)

    def _queue_key(self, request: Request) -> tuple[int, float, int]:
        return request.priority, request.arrival_time, self._arrival_order[request.request_id]
