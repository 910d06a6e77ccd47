"""Scheduling step N+1 before step N's output arrives: pending tokens, stops, preemption."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.scheduler import Scheduler

from .conftest import EOS, runner_output

MakeRequest = Callable[..., Request]
MakeScheduler = Callable[..., Scheduler]


def test_a_decode_is_scheduled_on_its_pending_token(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 10}
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_pending_tokens) == (10, 1)

    # Before the first step's output: the token it samples is the second step's input.
    second = s.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs[0].num_computed_tokens == 10
    assert (a.num_computed_tokens, a.num_pending_tokens) == (11, 2)

    (out,) = s.update_from_output(first, runner_output(s, first, {"a": 40}))
    assert out.new_token_ids == [40]
    assert (a.num_tokens, a.num_pending_tokens) == (11, 1)
    (out,) = s.update_from_output(second, runner_output(s, second, {"a": 41}))
    assert a.output_token_ids == [40, 41]
    assert a.num_pending_tokens == 0


def test_nothing_is_scheduled_past_max_tokens_or_max_model_len(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(max_model_len=32)
    s.add_request(make_request("short", 4, max_tokens=2))
    s.add_request(make_request("long", 30, max_tokens=None))
    steps = [s.schedule()]
    steps.append(s.schedule())
    # short's pending token is its second and last; long's reaches max_model_len 32.
    assert steps[1].num_scheduled_tokens == {"short": 1, "long": 1}
    third = s.schedule()
    assert third.is_empty
    outputs = [o for out in steps for o in s.update_from_output(out, runner_output(s, out))]
    assert [o.finish_reason for o in outputs] == [None, None, "length", "length"]
    assert not s.has_unfinished_requests()


def test_a_request_that_stops_early_drops_the_token_scheduled_after_it(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    first, second = s.schedule(), s.schedule()
    (out,) = s.update_from_output(first, runner_output(s, first, {"a": EOS}))
    assert out.finish_reason == "stop"
    assert s.update_from_output(second, runner_output(s, second, {"a": 9})) == []
    assert s.schedule().finished_req_ids == {"a"}


def test_a_request_preempted_while_its_step_runs_keeps_that_token(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    # 5 usable blocks of 4 tokens: a and b fill 4; b needs a fifth block, a sixth is missing.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=20)
    s.add_request(make_request("a", 8, max_tokens=4))
    s.add_request(make_request("b", 8, max_tokens=4, arrival_time=1.0))
    first = s.schedule()
    second = s.schedule()  # each decodes its pending token: a fifth block for a
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.preempted_req_ids == {"b"}
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_pending_tokens == 1

    outputs = s.update_from_output(first, runner_output(s, first, {"a": 50, "b": 60}))
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("a", [50]), ("b", [60])]
    assert b.all_token_ids[-1] == 60
    assert b.num_pending_tokens == 0
    s.update_from_output(second, runner_output(s, second, {"a": EOS}))
    # b resumes with its prompt and the token taken while it was preempted.
    resumed = s.schedule()
    (new,) = resumed.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.token_ids[-1] == 60
    assert new.num_computed_tokens == 8  # its prompt's blocks, from the prefix cache
    assert resumed.num_scheduled_tokens == {"b": 1}


def test_blocks_are_cached_only_once_their_tokens_are_known(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(block_size=4, enable_prefix_caching=True)
    s.add_request(make_request("a", 7))
    first = s.schedule()
    second = s.schedule()  # its pending token completes the second block
    manager = s.kv_cache_manager
    assert manager.num_cached_blocks["a"] == 1
    s.update_from_output(first, runner_output(s, first, {"a": 70}))
    s.update_from_output(second, runner_output(s, second, {"a": 71}))
    s.schedule()
    assert manager.num_cached_blocks["a"] == 2
    assert len(s.requests["a"].block_hashes) == 2
