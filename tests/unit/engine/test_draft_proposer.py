"""The draft-model proposer on a small random model: its drafts are the draft model's greedy
continuation, also after verifications that kept some drafts (the KV it reuses is right),
within its step budget and its blocks, which it gives back when requests end."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.draft_model import DraftModelProposer
from kvfleet.engine.worker.model_runner import ModelRunner
from kvfleet.engine.worker.setup import load_rank_model, resolve_setup

BLOCK = 4


@pytest.fixture(scope="module")
def config(tiny_config: Callable[..., Path]) -> EngineConfig:
    path = tiny_config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    return EngineConfig(model=str(path), load_format="dummy", device="cpu", dtype="float32")


def proposer(
    config: EngineConfig, num_blocks: int = 64, budget: int = 256, min_catch_up: int = 256
) -> DraftModelProposer:
    setup = resolve_setup(config)
    model = load_rank_model(config, setup, None)
    for weight in model.parameters():  # (not N(0, 0.02): continuations that vary with context)
        weight.data.mul_(25.0)
    runner = ModelRunner(model, BLOCK, setup.dtype, setup.device)
    runner.allocate_kv_cache(num_blocks)
    return DraftModelProposer(runner, num_blocks, budget, 256, min_catch_up)


def request(req_id: str, tokens: list[int]) -> Request:
    return Request(RequestId(req_id), tokens, SamplingParams(max_tokens=None), None, 0.0)


def continuation(fresh: DraftModelProposer, tokens: list[int], k: int) -> list[int]:
    """The draft model's greedy continuation, from a proposer that never saw the request."""
    req = request(f"fresh-{len(tokens)}-{tokens[-1]}", list(tokens))
    drafts = fresh.propose([req], k)[req.request_id]
    fresh.forget([req.request_id])
    return drafts


def test_drafts_follow_the_draft_model_across_verifications(config: EngineConfig) -> None:
    draft, fresh = proposer(config), proposer(config)
    rng = random.Random(0)
    requests = [request(f"r{i}", [rng.randrange(64) for _ in range(5 + 7 * i)]) for i in range(3)]
    for round_ in range(8):
        k = 1 + round_ % 4
        drafts = draft.propose(requests, k)
        for r in requests:
            assert drafts[r.request_id] == continuation(fresh, r.all_token_ids, k)
        # the target keeps a leading part of each request's drafts, then its own token
        for r in requests:
            kept = rng.randrange(k + 1)
            for token in [*drafts[r.request_id][:kept], rng.randrange(64)]:
                r.append_output_token(token)
    assert len({tuple(d) for d in drafts.values()}) > 1  # (the contexts matter)


def test_a_request_beyond_the_step_budget_drafts_once_caught_up(config: EngineConfig) -> None:
    draft, fresh = proposer(config, budget=16), proposer(config)
    short, long = request("short", [1, 2, 3]), request("long", list(range(30)))
    drafts = draft.propose([short, long], 2)
    assert set(drafts) == {"short"}  # long took the 13 tokens left, and drafts later
    assert draft.propose([long], 2) == {}  # 16 more: 29 of 30
    drafts = draft.propose([long], 2)
    assert drafts == {"long": continuation(fresh, long.all_token_ids, 2)}


def test_a_proposal_after_a_pause_feeds_a_few_backlogs_not_the_whole_batch(
    config: EngineConfig,
) -> None:
    """Eight requests, each 12 tokens the draft has not seen (2 of them generated), one draft
    asked for (an exploration): their backlogs share max(min_catch_up, 2 x 8 x 2) = 32 tokens,
    so two requests draft, a third is fed part of its backlog; those left wait (deferred, not
    counted as requests without drafts). Next time, more. Requests fresh from their prefill
    are fed their whole prompt at once."""
    draft, fresh = proposer(config, budget=256, min_catch_up=16), proposer(config)
    assert draft.catch_up_budget(8, 1) == 32
    assert draft.catch_up_budget(1, 1) == 16
    assert draft.catch_up_budget(100, 4) == 256  # (at most the step budget)
    rng = random.Random(1)
    requests = [request(f"r{i}", [rng.randrange(64) for _ in range(10)]) for i in range(8)]
    for r in requests:
        r.append_output_token(rng.randrange(64))
        r.append_output_token(rng.randrange(64))
    drafts = draft.propose(requests, 1)
    assert set(drafts) == {"r0", "r1"}
    assert draft.num_deferred == 6
    for r in requests[:2]:
        r.append_output_token(drafts[r.request_id][0])
    drafts = draft.propose(requests, 1)  # 1 + 1 + 4 + 12 + 12 + 2: r2, r3, r4 join
    assert set(drafts) == {"r0", "r1", "r2", "r3", "r4"}
    assert draft.num_deferred == 3
    for r in requests[:5]:
        assert drafts[r.request_id] == continuation(fresh, r.all_token_ids, 1)
    prefilled = [request(f"p{i}", [rng.randrange(64) for _ in range(11)]) for i in range(8)]
    for r in prefilled:
        r.append_output_token(rng.randrange(64))
    assert set(draft.propose(prefilled, 1)) == {r.request_id for r in prefilled}
    assert draft.num_deferred == 0


def test_no_drafts_without_blocks_and_blocks_come_back(config: EngineConfig) -> None:
    draft = proposer(config, num_blocks=6)  # 5 usable blocks of 4 tokens
    first, second = request("a", list(range(10))), request("b", list(range(10)))
    drafts = draft.propose([first, second], 3)  # 12 slots each: 3 blocks each
    assert set(drafts) == {"a"}
    assert draft.pool.num_free_blocks == 2
    draft.forget([RequestId("a"), RequestId("never-seen")])
    assert draft.pool.num_free_blocks == 5
    assert set(draft.propose([second], 3)) == {"b"}
    again = request("a", [5, 6, 7])  # an id reused after it ended
    assert set(draft.propose([again], 1)) == {"a"}


def test_proposing_again_without_verification(config: EngineConfig) -> None:
    """Drafts proposed but never verified (the step did not take them), or a single token
    added that happens to be the first draft: the next proposal is still the continuation."""
    draft, fresh = proposer(config), proposer(config)
    r = request("r", [3, 1, 4, 1, 5, 9, 2, 6])
    first = draft.propose([r], 3)[r.request_id]
    assert draft.propose([r], 3)[r.request_id] == first
    r.append_output_token(first[0])  # decoded alone, without its drafts
    assert draft.propose([r], 2)[r.request_id] == continuation(fresh, r.all_token_ids, 2)


def test_a_draft_model_of_another_vocabulary_is_refused(
    config: EngineConfig, tiny_config: Callable[..., Path]
) -> None:
    other = tiny_config(vocab_size=96)
    speculative = {"method": "draft", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(config.model, load_format="dummy", device="cpu", speculative_config=speculative)
    with pytest.raises(ValueError, match="speculative method must be one of"):
        LLM(
            config.model,
            load_format="dummy",
            device="cpu",
            speculative_config={"method": "eagle", "num_speculative_tokens": 2},
        )
