"""The scheduler's promises over random workloads (hypothesis): requests arriving over time,
with random prompts, lengths and priorities, in tight pools, with and without the prompt cap
and asynchronous steps.

- every step stays within its token budget and seats, and every request finishes;
- a workload of known ends (every request ignores EOS) is never preempted;
- while a request waits to start with a seat free, no prompt computes more than the cap;
- a running request scheduled after a long prompt still gets its token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.sampling_params import SamplingParams

from .conftest import EOS, runner_output

BLOCK, MAX_MODEL_LEN = 4, 64


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    priority: int


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 12),
        prompt_len=st.integers(1, 48),
        max_tokens=st.integers(1, 16),
        priority=st.integers(0, 1),
    ),
    min_size=1,
    max_size=12,
)


def _run(
    workload: list[Arrival],
    ignore_eos: bool,
    num_blocks: int,
    budget: int,
    cap: int | None,
    check_step: Callable[[dict[str, int], set[str], int], None],
) -> Scheduler:
    """Serve `workload` to the end, one step at a time (tokens 7, never EOS)."""
    scheduler = Scheduler(
        KVCacheManager(num_blocks, BLOCK, enable_caching=True),
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=cap,
    )
    pending = sorted(enumerate(workload), key=lambda item: item[1].step)
    for number in range(600):
        while pending and pending[0][1].step <= number:
            i, arrival = pending.pop(0)
            prompt_len = min(arrival.prompt_len, MAX_MODEL_LEN - 1)
            scheduler.add_request(
                Request(
                    request_id=RequestId(f"r{i}"),
                    prompt_token_ids=[100 + i] * prompt_len,
                    sampling_params=SamplingParams(
                        max_tokens=arrival.max_tokens, ignore_eos=ignore_eos
                    ),
                    eos_token_id=EOS,
                    arrival_time=float(i),
                    priority=arrival.priority,
                )
            )
        if not pending and not scheduler.has_unfinished_requests():
            return scheduler
        waiting_before = {r.request_id for r in scheduler.waiting}
        running_before = scheduler.num_running
        running_ids = [r.request_id for r in scheduler.running]
        finished_early = {  # (its pending token is its last: nothing more to compute)
            r.request_id for r in scheduler.running if r.num_pending_tokens
        }
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert scheduler.num_running <= 4
        check_step(out.num_scheduled_tokens, waiting_before, running_before)
        if not out.preempted_req_ids:  # (every running request was scheduled: none starved)
            assert set(running_ids) <= set(out.num_scheduled_tokens) | finished_early, running_ids
        scheduler.update_from_output(out, runner_output(scheduler, out))
    raise AssertionError("the workload did not finish in 600 steps")


@settings(max_examples=60, deadline=None)
@given(arrivals, st.booleans(), st.integers(17, 40), st.sampled_from([8, 16, 64]))
def test_every_request_finishes_and_known_ends_are_never_preempted(
    workload: list[Arrival], ignore_eos: bool, num_blocks: int, budget: int
) -> None:
    scheduler = _run(workload, ignore_eos, num_blocks, budget, None, lambda *_: None)
    if ignore_eos:
        assert scheduler.num_preemptions == 0


@settings(max_examples=60, deadline=None)
@given(arrivals, st.integers(1, 12))
def test_no_prompt_passes_the_cap_while_a_request_waits_to_start(
    workload: list[Arrival], cap: int
) -> None:
    def check(scheduled: dict[str, int], waited: set[str], running: int) -> None:
        """While a request was left waiting with a seat free, no prompt passed the cap."""
        if waited - set(scheduled) and running < 4:
            assert all(n <= cap for n in scheduled.values()), (scheduled, waited)

    _run(workload, True, 40, 32, cap, check)
