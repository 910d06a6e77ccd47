"""Factories for the pure engine core: real small objects, no mocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvfleet.engine.sampling_params import SamplingParams

EOS = 2


@pytest.fixture
def make_request() -> Callable[..., Request]:
    def make_request(
        request_id: str,
        prompt: Sequence[int] | int,
        *,
        max_tokens: int | None = 8,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_name: str | None = None,
        **params: object,
    ) -> Request:
        # An int prompt means that many distinct tokens, unique to this request id.
        if isinstance(prompt, int):
            base = 1000 * (1 + sum(map(ord, request_id)))
            prompt = [base + i for i in range(prompt)]
        return Request(
            request_id=RequestId(request_id),
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
            eos_token_id=EOS,
            arrival_time=arrival_time,
            priority=priority,
            lora_name=lora_name,
        )

    return make_request


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    def make_scheduler(
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 64,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
        max_prefill_seqs: int | None = None,
        long_prefill_token_threshold: int | None = None,
    ) -> Scheduler:
        manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        return Scheduler(
            manager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_prefill_seqs=max_prefill_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            max_loras=max_loras,
        )

    return make_scheduler


def runner_output(
    scheduler: Scheduler, out: SchedulerOutput, tokens: dict[str, int] | None = None
) -> ModelRunnerOutput:
    """What a runner returns: a token for each request whose step reached its last input (the
    scheduler holds that token as pending; a request finished since sampled too), `tokens` or 7."""
    tokens = tokens or {}
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is None or request.num_pending_tokens > 0
        sampled.append([tokens.get(req_id, 7)] if done else [])
    return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


@pytest.fixture
def step() -> Callable[..., tuple[SchedulerOutput, list]]:
    """One engine step without a model: schedule, sample fixed tokens, update."""

    def step(
        scheduler: Scheduler, tokens: dict[str, int] | None = None
    ) -> tuple[SchedulerOutput, list]:
        out = scheduler.schedule()
        return out, scheduler.update_from_output(out, runner_output(scheduler, out, tokens))

    return step
