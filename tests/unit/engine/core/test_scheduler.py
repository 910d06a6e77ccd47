"""Scheduler: token budget, chunked prefill, admission, prefix hits, preemption, stops, abort."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet.engine.config import SchedulerConfig
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


def test_a_long_prompt_leaves_room_for_requests_arriving_during_its_prefill(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """At the engine's defaults (2,048 tokens a step, a prompt capped at half while requests
    wait to start): a request arriving during a 3,000-token prefill, or an 8,000-token one, is
    scheduled at the next step; alone, the long prompt takes the whole budget, and beside the
    late request's decodes all of it but their tokens. Without the cap the arrival waits until
    the 8,000-token prefill's last step."""
    cap = SchedulerConfig().prefill_chunk_cap
    assert cap == 1024
    for prompt_len, cap_or_none, started_at in [(3000, cap, 2), (8000, cap, 2), (8000, None, 4)]:
        s = make_scheduler(
            num_blocks=2100, max_num_batched_tokens=2048, max_model_len=8192,
            long_prefill_token_threshold=cap_or_none,
        )  # fmt: skip
        s.add_request(make_request("long", prompt_len))
        out, _ = step(s)
        assert out.num_scheduled_tokens == {"long": 2048}  # (alone: the whole step)
        s.add_request(make_request("late", 10))
        started = None
        for number in range(2, 8):
            out, _ = step(s)
            if "late" in out.num_scheduled_tokens:
                started = number
                break
            assert out.num_scheduled_tokens == {"long": 2048}
        assert started == started_at, (prompt_len, cap_or_none)
        if cap_or_none is not None:
            left = prompt_len - 2048
            assert out.num_scheduled_tokens == {"long": min(1024, left), "late": 10}
            if left > 1024:  # (nobody waits: all but the late request's decode token)
                out, _ = step(s)
                assert out.num_scheduled_tokens == {"long": min(2047, left - 1024), "late": 1}


def test_the_prompt_cap_applies_to_admissions_and_spares_decodes(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """While others wait to start, a long prompt ahead of them takes at most the cap, the last
    admitted what the budget leaves; once nobody waits, a running prompt leaves one token to
    each running request after it (b's decode, c's next chunk); a decode is never cut."""
    s = make_scheduler(
        num_blocks=200, max_num_batched_tokens=64, max_model_len=256,
        long_prefill_token_threshold=20,
    )  # fmt: skip
    s.add_request(make_request("a", 100, arrival_time=0))
    s.add_request(make_request("b", 5, arrival_time=1))
    s.add_request(make_request("c", 100, arrival_time=2))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20, "b": 5, "c": 39}
    out, _ = step(s)  # (nobody waits: a leaves a token to each of b and c, after it)
    assert out.num_scheduled_tokens == {"a": 62, "b": 1, "c": 1}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 18, "b": 1, "c": 45}
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be at least 1"):
        make_scheduler(long_prefill_token_threshold=0)
    # (the engine setting: 0 turns the cap off; below that refused before anything loads)
    assert SchedulerConfig(long_prefill_token_threshold=0).prefill_chunk_cap is None
    with pytest.raises(ValueError, match=r"must be 0 \(no cap\) or more, got -1"):
        SchedulerConfig(long_prefill_token_threshold=-1)


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


def test_requests_of_known_end_start_only_when_the_pool_holds_them_to_it(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """8 requests that ignore EOS (8 prompt tokens, 12 out: KV for 19 tokens, 5 blocks of 4)
    in a pool of 21 usable blocks: four run at once, the fifth starts when one finishes, and
    nothing is ever preempted. The same requests stopping at EOS (their end unknown) start by
    their prompts' blocks and are preempted as they grow."""
    for ignore_eos, most_running, preempted in [(True, 4, 0), (False, 8, 4)]:
        s = make_scheduler(num_blocks=22, max_model_len=32, enable_prefix_caching=False)
        for i in range(8):
            s.add_request(make_request(f"r{i}", 8, max_tokens=12, arrival_time=i,
                                       ignore_eos=ignore_eos))  # fmt: skip
        finished, running = [], []
        for _ in range(200):
            if not s.has_unfinished_requests():
                break
            _, outputs = step(s)
            running.append(s.num_running)
            finished += [o.req_id for o in outputs if o.finished]
        assert sorted(finished) == [f"r{i}" for i in range(8)]
        assert (max(running), s.num_preemptions) == (most_running, preempted), ignore_eos
    # (one whose prompt fits but whose end does not waits)
    s = make_scheduler(num_blocks=41, max_model_len=128, max_num_batched_tokens=128)
    s.add_request(make_request("x", 100, max_tokens=20))  # (end unknown: 25 blocks now)
    s.add_request(make_request("y", 8, max_tokens=60, ignore_eos=True))  # (17 blocks at its end)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["x"]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 15


def test_a_request_waiting_for_room_asks_the_prefix_cache_once(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """Prefix-cache statistics count a request at its first start, not at every step it
    waited (its end did not fit) nor after a preemption."""
    s = make_scheduler(num_blocks=41, max_model_len=128, max_num_batched_tokens=128)
    s.add_request(make_request("x", 100, max_tokens=3, ignore_eos=True))  # (25 blocks, then 26)
    s.add_request(make_request("y", 8, max_tokens=60, ignore_eos=True))  # (17 blocks at its end)
    kv = s.kv_cache_manager
    for _ in range(3):
        step(s)
        assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (100, 0)  # (y waits)
    for _ in range(80):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (108, 0)


def test_a_watermark_of_the_pool_stays_free_when_requests_start(
    make_scheduler: MakeScheduler, make_request: MakeRequest, step: Step
) -> None:
    """1% of 400 usable blocks (4) stays free when a request starts beside running ones; into
    an idle engine a request starts that takes the whole pool to its end."""
    s = make_scheduler(num_blocks=401, block_size=4, max_num_batched_tokens=2048,
                       max_model_len=1600)  # fmt: skip
    s.add_request(make_request("whole", 800, max_tokens=801, ignore_eos=True))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"whole": 800}  # (400 blocks to its end: all of them)
    s.finish_requests(["whole"], RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("a", 4 * 390))  # (end unknown: its prompt's 390 blocks)
    s.add_request(make_request("b", 4 * 7))  # 7 more blocks: 3 would stay free, under 4
    s.add_request(make_request("c", 4 * 6))  # (waits behind b: first come, first served)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a"]
    out, _ = step(s)
    assert "b" not in out.num_scheduled_tokens
    assert s.kv_cache_manager.block_pool.num_free_blocks == 400 - 391  # (a's first token)


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
