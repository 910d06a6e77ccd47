"""Scheduler: token budget, chunked prefill, admission, prefix hits, preemption, stops, abort."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import NewRequestData

from .conftest import EOS, runner_output

MakeRequest = Callable[..., Request]
MakeScheduler = Callable[..., Scheduler]
Step = Callable[..., tuple]


def test_running_first_then_waiting_with_chunked_prefill(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    for name in "abc":
        s.add_request(make_request(name, 10))

    out, outputs = step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prompt is chunked
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    assert [o.req_id for o in outputs] == ["a"]  # b sampled nothing yet

    out, outputs = step(s)
    # a decodes, b finishes its prompt, c gets the rest of the budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a", "b"]
    assert out.scheduled_cached_reqs[1].num_computed_tokens == 6
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert out.total_num_scheduled_tokens == 15
    assert [o.req_id for o in outputs] == ["a", "b", "c"]


def test_without_chunked_prefill_a_prompt_waits_for_room(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 30))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 40}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 30}
    with pytest.raises(ValueError, match="without chunked prefill"):
        make_scheduler(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def test_max_num_seqs_limits_admission(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler(max_num_seqs=2)
    for name in "abc":
        s.add_request(make_request(name, 3))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_a_burst_is_prefilled_a_slice_at_a_time_first_come(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """Issue 27, defect 8: 250 streams at once were all prefilled before any decoded (time
    to first token p50 103 s for every request). With at most 4 prompts in prefill a step,
    the first to arrive decode from the second step on and the first 12 all have a token
    after three steps, while the budget alone would have taken all 40 in the first."""
    s = make_scheduler(max_num_batched_tokens=256, max_num_seqs=64, max_prefill_seqs=4)
    names = [f"r{i:02d}" for i in range(40)]
    for i, name in enumerate(names):
        s.add_request(make_request(name, 6, arrival_time=float(i)))
    sampled: list[str] = []
    for number in range(1, 4):
        out, outputs = step(s)
        new = [r.req_id for r in out.scheduled_new_reqs]
        assert new == names[4 * (number - 1) : 4 * number]  # in arrival order
        decoding = [r for r, n in out.num_scheduled_tokens.items() if n == 1]
        assert decoding == names[: 4 * (number - 1)]
        sampled += [o.req_id for o in outputs if o.new_token_ids and o.req_id not in sampled]
    assert sampled == names[:12]
    with pytest.raises(ValueError, match="max_prefill_seqs must be at least 1"):
        make_scheduler(max_prefill_seqs=0)

    unbounded = make_scheduler(max_num_batched_tokens=256, max_num_seqs=64)
    for i, name in enumerate(names):
        unbounded.add_request(make_request(name, 6, arrival_time=float(i)))
    out, _ = step(unbounded)
    assert len(out.scheduled_new_reqs) == 40


def test_priority_then_arrival(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler(max_num_seqs=2)
    s.add_request(make_request("late-urgent", 3, arrival_time=5.0, priority=-1))
    s.add_request(make_request("first", 3, arrival_time=1.0))
    s.add_request(make_request("second", 3, arrival_time=2.0))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["late-urgent", "first"]


def test_prefix_hit_computes_only_new_tokens(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler()
    shared = list(range(500, 520))  # 5 blocks of 4
    s.add_request(make_request("a", [*shared, 1, 2]))
    step(s)
    s.add_request(make_request("b", [*shared, 3, 4, 5]))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 20
    assert out.num_scheduled_tokens["b"] == 3
    assert (
        new.block_ids[:5]
        == s.kv_cache_manager.get_block_ids(out.scheduled_cached_reqs[0].req_id)[:5]
    )
    assert s.requests["b"].num_cached_tokens == 20


def test_preemption_frees_newest_and_resumes_it_first(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens fill 4, decoding needs more.
    s = make_scheduler(num_blocks=7, max_model_len=24, enable_prefix_caching=False)
    s.add_request(make_request("old", 8, max_tokens=12, arrival_time=0))
    s.add_request(make_request("new", 8, max_tokens=12, arrival_time=1))
    newest = make_request("newest", 8, max_tokens=12, arrival_time=2)
    s.add_request(newest)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["old", "new", "newest"]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0

    out, _ = step(s)  # each needs a new block for token 9: the newest is preempted
    assert out.preempted_req_ids == {"newest"}
    assert out.num_scheduled_tokens == {"old": 1, "new": 1}
    assert s.requests["newest"].status is RequestStatus.PREEMPTED
    assert "newest" in out.finished_req_ids  # the runner drops its state
    assert s.num_preemptions == 1

    finished = []
    resumed: list[NewRequestData] = []
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        out, outputs = step(s)
        resumed += [new for new in out.scheduled_new_reqs if new.req_id == "newest"]
        finished += [o.req_id for o in outputs if o.finished]
    assert sorted(finished) == ["new", "newest", "old"]
    # Resumed with its prompt and the token it had produced, recomputed from scratch.
    assert len(resumed) == 1
    assert resumed[0].token_ids == [*newest.prompt_token_ids, 7]
    assert resumed[0].num_computed_tokens == 0


def test_token_stops(make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step) -> None:
    s = make_scheduler(max_model_len=12)
    s.add_request(make_request("eos", 3))
    s.add_request(make_request("ignore", 3, ignore_eos=True, max_tokens=2))
    s.add_request(make_request("stop-id", 3, stop_token_ids=[9]))
    s.add_request(make_request("length", 3, max_tokens=2))
    s.add_request(make_request("context", 10, max_tokens=None))
    tokens = {"eos": EOS, "ignore": EOS, "stop-id": 9, "length": 5, "context": 5}

    _, outputs = step(s, tokens)
    done = {o.req_id: (o.finish_reason, o.stop_reason) for o in outputs if o.finished}
    assert done == {"eos": ("stop", None), "stop-id": ("stop", 9)}
    _, outputs = step(s, tokens)
    done = {o.req_id: (o.finish_reason, o.stop_reason) for o in outputs if o.finished}
    # "context" reaches max_model_len (10 + 2 = 12).
    assert done == {
        "ignore": ("length", None),
        "length": ("length", None),
        "context": ("length", None),
    }
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.usage == 0.0


def test_abort_waiting_and_running(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("running", 5))
    s.add_request(make_request("waiting", 5))
    step(s)
    s.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.usage == 0.0
    out = s.schedule()
    assert out.is_empty
    assert out.finished_req_ids == {"running", "waiting"}
    assert s.schedule().finished_req_ids == set()


def test_abort_during_a_step_drops_its_output(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:

    s = make_scheduler()
    s.add_request(make_request("a", 5))
    out = s.schedule()
    result = runner_output(s, out)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, result) == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "the prompt is empty"), (64, "maximum context length is 64")],
)
def test_bad_requests_are_refused(
    make_scheduler: MakeScheduler, make_request: MakeRequest, prompt: object, message: str
) -> None:
    s = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match=message):
        s.add_request(make_request("x", prompt))
    assert not s.has_unfinished_requests()


def test_duplicate_id_and_too_small_cache(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_scheduler(num_blocks=4, max_model_len=64)


def test_max_loras_bounds_distinct_adapters_running(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    scheduler = make_scheduler(max_loras=2)
    requests = [
        make_request("a1", 4, lora_name="a", max_tokens=2),
        make_request("b1", 4, lora_name="b", max_tokens=2),
        make_request("c1", 4, lora_name="c", max_tokens=2),  # a third adapter: waits
        make_request("base", 4, max_tokens=2),  # the base model: passes it
        make_request("a2", 4, lora_name="a", max_tokens=2),  # a resident adapter: passes
    ]
    for request in requests:
        scheduler.add_request(request)
    out, _ = step(scheduler)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a1", "b1", "base", "a2"]
    assert [n.lora_name for n in out.scheduled_new_reqs] == ["a", "b", None, "a"]
    assert [r.request_id for r in scheduler.waiting] == ["c1"]
    step(scheduler)  # every running request finishes (2 tokens each)
    out, _ = step(scheduler)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c1"]
