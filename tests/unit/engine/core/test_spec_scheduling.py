"""The scheduler with draft tokens: which drafts a step verifies, the rollback of rejected ones,
stops inside a step's tokens, and the speculative counters."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

from .conftest import EOS

MakeRequest = Callable[..., Request]
MakeScheduler = Callable[..., Scheduler]


def decode_ready(s: Scheduler, *requests: Request) -> None:
    """Add the requests and run their prompts, each sampling token 7."""
    for request in requests:
        s.add_request(request)
    out = s.schedule()
    s.update_from_output(out, emitted(out, {r: [7] for r in out.num_scheduled_tokens}))


def emitted(out: SchedulerOutput, tokens: dict[RequestId, list[int]]) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [tokens.get(r, []) for r in req_ids], [None] * len(req_ids))


def test_a_decoding_request_computes_its_drafts_and_rolls_back_the_rejected(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(block_size=4)
    r = make_request("r", 5, max_tokens=20)
    decode_ready(s, r)
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)

    out = s.schedule({r.request_id: [11, 12, 13]})
    assert out.scheduled_spec_decode_tokens == {"r": [11, 12, 13]}
    assert out.num_scheduled_tokens == {"r": 4}  # its last token, then the drafts
    assert r.num_computed_tokens == 9
    assert len(s.kv_cache_manager.get_block_ids(r.request_id)) == 3  # slots for 9 tokens
    # the first draft kept, the second rejected and replaced by 20
    (output,) = s.update_from_output(out, emitted(out, {r.request_id: [11, 20]}))
    assert output.new_token_ids == [11, 20]
    assert r.output_token_ids == [7, 11, 20]
    assert (r.num_tokens, r.num_computed_tokens, r.num_pending_tokens) == (8, 7, 0)
    # only known tokens' blocks are cached, never one holding a draft: 1 (6 tokens were known
    # when the slots were allocated), then 2 once the kept draft is known
    assert s.kv_cache_manager.num_cached_blocks[r.request_id] == 1
    stats = s.spec_decode_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_rejections == 1
    assert stats.mean_acceptance_length == 2.0

    out = s.schedule()  # no drafts: one token, the one that replaced the rejected draft
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.scheduled_spec_decode_tokens == {}
    assert r.num_computed_tokens == 8
    s.update_from_output(out, emitted(out, {r.request_id: [21]}))
    assert s.kv_cache_manager.num_cached_blocks[r.request_id] == 2


def test_drafts_are_cut_to_max_tokens_the_context_and_the_budget(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(max_model_len=12, max_num_batched_tokens=64)
    near_max_tokens = make_request("m", 3, max_tokens=4)  # 1 output: room for 2 drafts + 1
    near_context = make_request("c", 9, max_tokens=None)  # 10 tokens of 12: room for 1 draft
    plenty = make_request("p", 3, max_tokens=30)
    decode_ready(s, near_max_tokens, near_context, plenty)
    drafts = {r: [1, 2, 3, 4, 5] for r in map(RequestId, "mcp")}
    out = s.schedule(drafts)
    assert out.scheduled_spec_decode_tokens == {"m": [1, 2], "c": [1], "p": [1, 2, 3, 4, 5]}
    s.update_from_output(out, emitted(out, {"m": [1, 2, 9], "c": [1, 9], "p": [9]}))
    assert near_max_tokens.status.is_finished  # 4 tokens: max_tokens
    assert near_context.status.is_finished  # 12 tokens: the context
    assert plenty.num_computed_tokens == plenty.num_tokens - 1

    tight = make_scheduler(max_num_batched_tokens=3)
    r = make_request("r", 2, max_tokens=30)
    decode_ready(tight, r)
    out = tight.schedule({r.request_id: [1, 2, 3, 4]})
    assert out.scheduled_spec_decode_tokens == {"r": [1, 2]}  # 1 + 2 tokens: the budget


def test_drafts_wait_for_prefill_and_pending_tokens(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    long = make_request("long", 10)
    s.add_request(long)
    out = s.schedule({long.request_id: [1, 2]})  # still in its prompt: no drafts
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"long": 4}

    s = make_scheduler()
    r = make_request("r", 3)
    s.add_request(r)
    s.schedule()  # its prompt, the first token pending (asynchronous scheduling)
    out = s.schedule({r.request_id: [1, 2]})
    assert out.scheduled_spec_decode_tokens == {}


def test_a_stop_token_inside_the_kept_drafts_ends_the_request_there(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler()
    eos, stop_id = make_request("eos", 4, max_tokens=20), make_request("s", 4, stop_token_ids=[9])
    decode_ready(s, eos, stop_id)
    out = s.schedule({eos.request_id: [5, EOS, 6], stop_id.request_id: [9, 8]})
    outputs = s.update_from_output(out, emitted(out, {"eos": [5, EOS, 6, 3], "s": [9, 8, 1]}))
    by_id = {o.req_id: o for o in outputs}
    assert by_id["eos"].new_token_ids == [5, EOS]
    assert by_id["eos"].finish_reason == "stop"
    assert (by_id["s"].new_token_ids, by_id["s"].stop_reason) == ([9], 9)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.usage == 0.0
    assert s.spec_decode_stats.num_accepted_tokens == 3 + 2  # counted as verified


def test_drafts_of_a_preempted_request_are_dropped(
    make_scheduler: MakeScheduler, make_request: MakeRequest
) -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)  # 3 usable blocks
    old, new = make_request("old", 3, max_tokens=9), make_request("new", 3, max_tokens=9)
    decode_ready(s, old, new)  # one block each
    out = s.schedule({old.request_id: [1, 2, 3, 4, 5], new.request_id: [1, 2]})
    # old's 9 slots need 3 blocks: new (the newest) is preempted for them
    assert out.preempted_req_ids == {"new"}
    assert out.scheduled_spec_decode_tokens == {"old": [1, 2, 3, 4, 5]}
    assert new.num_computed_tokens == 0
