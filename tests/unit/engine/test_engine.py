"""LLMEngine behaviour on a small random model: prefix caching, preemption, bad input, n, seeds,
asynchronous scheduling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.llm import LLM
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HfModelDir = Callable[[str], tuple[Any, Path]]


@pytest.fixture
def make_engine(hf_model_dir: HfModelDir) -> Callable[..., LLMEngine]:
    _, folder = hf_model_dir("llama2-tied")

    def make_engine(num_blocks: int = 256, budget: int = 128, **kwargs: Any) -> LLMEngine:
        caching = kwargs.pop("enable_prefix_caching", True)
        swap_space = kwargs.pop("swap_space_gib", CacheConfig.swap_space_gib)
        return LLMEngine(
            EngineConfig(
                model=str(folder),
                dtype="float32",
                skip_tokenizer_init=True,
                max_model_len=kwargs.pop("max_model_len", 512),
                cache=CacheConfig(
                    block_size=16,
                    num_blocks=num_blocks,
                    enable_prefix_caching=caching,
                    swap_space_gib=swap_space,
                ),
                scheduler=SchedulerConfig(
                    max_num_batched_tokens=budget,
                    async_scheduling=kwargs.pop("async_scheduling", True),
                ),
                **kwargs,
            )
        )

    return make_engine


def run(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("the engine did not finish its requests")


def tokens(n: int, offset: int) -> list[int]:
    return [3 + (offset + 7 * i) % 380 for i in range(n)]


def test_shared_prefix_computes_only_new_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    prefix = tokens(500, 0)
    a_prompt, b_prompt = [*prefix, *tokens(9, 1)], [*prefix, *tokens(20, 2)]
    engine = make_engine(budget=1024, max_model_len=1024)
    engine.add_request("a", a_prompt, GREEDY)
    engine.step()
    a_blocks = engine.kv_cache_manager.get_block_ids("a")
    a_out = run(engine)["a"]

    engine.add_request("b", b_prompt, GREEDY)
    engine.step()
    step = engine.last_scheduler_output
    assert step is not None
    (new,) = step.scheduled_new_reqs
    # 31 full blocks of 16 hold 496 prefix tokens; the rest of b is computed.
    assert new.num_computed_tokens == 496
    assert step.num_scheduled_tokens["b"] == len(b_prompt) - 496
    assert engine.kv_cache_manager.get_block_ids("b")[:31] == a_blocks[:31]
    b_out = run(engine)["b"]
    assert b_out.num_cached_tokens == 496

    cold = make_engine(budget=1024, max_model_len=1024, enable_prefix_caching=False)
    cold.add_request("a", a_prompt, GREEDY)
    cold.add_request("b", b_prompt, GREEDY)
    cold_out = run(cold)
    assert cold_out["a"].outputs[0].token_ids == a_out.outputs[0].token_ids
    assert cold_out["b"].outputs[0].token_ids == b_out.outputs[0].token_ids
    assert cold_out["b"].num_cached_tokens == 0


# Swap space: the default (room for every preempted request), none (recompute), and room for
# one request's blocks at a time (~6 blocks of this model: 2 layers x 2 x 16 x 4 x 16 x 4 B).
SWAP_SPACES = {"swap": CacheConfig.swap_space_gib, "recompute": 0.0, "some": 40_000 / 2**30}


@pytest.mark.parametrize("swap", list(SWAP_SPACES))
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_small_kv_pool_preempts_and_every_request_completes(
    make_engine: Callable[..., LLMEngine], ignore_eos: bool, swap: str
) -> None:
    """Requests whose end is unknown (they may stop at EOS) start by their prompts and are
    preempted as they grow, then swapped back in (or recomputed: no swap space, or too little
    for them); ignoring EOS, their end is known and they start only when the pool holds them
    to it: no preemption. Either way each one's output is its output alone."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=ignore_eos)
    prompts = {f"r{i}": tokens(30 + 5 * i, i) for i in range(6)}
    alone = {}
    for rid, prompt in prompts.items():
        engine = make_engine(max_model_len=128)
        engine.add_request(rid, prompt, params)
        alone[rid] = run(engine)[rid].outputs[0].token_ids
    assert all(len(out) == 40 for out in alone.values())  # (no EOS: they all grow)

    # 12 usable blocks of 16 tokens: room for two or three of the six at a time.
    tight = make_engine(
        num_blocks=13, max_model_len=128, budget=64, swap_space_gib=SWAP_SPACES[swap]
    )
    for rid, prompt in prompts.items():
        tight.add_request(rid, prompt, params)
    together = run(tight)
    stats = tight.scheduler.stats()
    assert (stats.num_preemptions > 0) == (not ignore_eos)
    swapped = {"swap": stats.num_preemptions, "recompute": 0}.get(swap)
    if swap == "some":  # (some swapped, the others recomputed)
        assert 0 < stats.num_preemptions_swapped < stats.num_preemptions or ignore_eos
    else:
        assert stats.num_preemptions_swapped == swapped
    assert {rid: out.outputs[0].token_ids for rid, out in together.items()} == alone
    kv = tight.kv_cache_manager
    assert kv.usage == 0.0
    assert sorted(kv.free_host_blocks) == list(range(kv.num_host_blocks))  # (all given back)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], {}, "a prompt must be|the prompt is empty"),
        (tokens(600, 0), {}, "maximum context length is 512"),
        ([1, 2, 999], {}, "token id 999 is out of range"),
        ([1, 2, True], {}, "a prompt must be a string or a list of token ids"),
        ("hello", {}, "this engine has no tokenizer"),
        ([1, 2], {"max_tokens": 0}, r"max_tokens must be in \[1, 2147483647\]"),
        ([1, 2], {"top_k": 10**30}, r"top_k must be in \[1, 2147483647\]"),
        ([1, 2], {"seed": 2**64}, "seed must be a 64-bit integer"),
        ([1, 2], {"temperature": float("inf")}, "temperature must be non-negative"),
        ([1, 2], {"stop_token_ids": [2**40]}, "stop_token_ids must be a list of token ids"),
        ([1, 2], {"temperature": -1}, "temperature must be non-negative"),
        ([1, 2], {"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ([1, 2], {"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ([1, 2], {"stop": {"bad": 1}}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_input_is_refused_and_others_keep_running(
    make_engine: Callable[..., LLMEngine], prompt: Any, params: dict[str, Any], message: str
) -> None:
    engine = make_engine()
    engine.add_request("good-1", tokens(20, 1), GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(**params))
    with pytest.raises(ValueError, match="cache_salt must be Unicode text"):
        engine.add_request("salted", [1, 2], GREEDY, cache_salt="\ud800")
    engine.add_request("good-2", tokens(20, 2), GREEDY)
    finished = run(engine)
    assert sorted(finished) == ["good-1", "good-2"]
    assert all(len(o.outputs[0].token_ids) == 8 for o in finished.values())


def test_offline_batch_with_a_bad_prompt_runs_nothing(hf_model_dir: HfModelDir) -> None:
    _, folder = hf_model_dir("llama2-tied")
    llm = LLM(
        str(folder), dtype="float32", skip_tokenizer_init=True, num_blocks=64, max_model_len=256
    )
    with pytest.raises(ValueError, match="prompt 1: token id 500 is out of range"):
        llm.generate([[5, 6, 7], [500]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([[5, 6, 7]], GREEDY)
    assert len(out.outputs[0].token_ids) == 8


def test_n_and_seeds(make_engine: Callable[..., LLMEngine]) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=42, ignore_eos=True)
    engine = make_engine()
    engine.add_request("x", tokens(10, 3), sampled)
    first = run(engine)["x"]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3  # distinct samples

    # The same seeds give the same samples, whatever else shares the batch.
    engine.add_request("noise", tokens(30, 4), SamplingParams(temperature=1.0, max_tokens=20))
    engine.add_request("x2", tokens(10, 3), sampled)
    again = run(engine)["x2"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_request_timings(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    engine.add_request("t", tokens(10, 5), GREEDY)
    metrics = run(engine)["t"].metrics
    assert metrics.queue_time is not None
    assert metrics.queue_time >= 0
    assert metrics.time_to_first_token is not None
    assert metrics.time_to_first_token > 0
    assert metrics.decode_time is not None
    assert metrics.decode_time > 0
    assert metrics.finished_time is not None
    assert metrics.finished_time >= metrics.last_token_time


def test_async_scheduling_runs_one_step_behind(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    engine.add_request("a", tokens(10, 6), GREEDY)
    assert engine.step() == []  # the prompt's step is launched; its token comes next step
    step = engine.last_scheduler_output
    assert step is not None
    assert step.num_scheduled_tokens == {"a": 10}
    (out,) = engine.step()
    assert len(out.outputs[0].token_ids) == 1
    step = engine.last_scheduler_output
    assert step is not None
    assert step.num_scheduled_tokens == {"a": 1}

    sync = make_engine(async_scheduling=False)
    sync.add_request("a", tokens(10, 6), GREEDY)
    (out,) = sync.step()
    assert len(out.outputs[0].token_ids) == 1


def _mixed_run(engine: LLMEngine, stop_token: int | None) -> dict[str, RequestOutput]:
    """Chunked prompts, preemption, early stops, sampling with seeds, n, logprobs, penalties."""
    requests: list[tuple[list[int], SamplingParams]] = [
        (tokens(90, 10), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (
            tokens(40, 11),
            SamplingParams(
                temperature=1,
                seed=9,
                max_tokens=30,
                stop_token_ids=[stop_token] if stop_token is not None else [],
                ignore_eos=True,
            ),
        ),
        (tokens(7, 12), SamplingParams(temperature=1, seed=5, max_tokens=25, logprobs=3, n=2)),
        (tokens(150, 13), SamplingParams(temperature=0.7, top_p=0.9, seed=6, max_tokens=9)),
        (tokens(33, 14), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    ]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    finished = run(engine)
    # A request with penalties joins while others run: those steps go one at a time.
    engine.add_request(
        "p", tokens(20, 15), SamplingParams(presence_penalty=1.5, seed=3, max_tokens=12)
    )
    engine.add_request("q", tokens(25, 16), SamplingParams(temperature=0, max_tokens=12))
    return finished | run(engine)


def test_async_scheduling_gives_the_outputs_of_one_step_at_a_time(
    make_engine: Callable[..., LLMEngine],
) -> None:
    # 20 blocks of 16 tokens for ~440 tokens of demand: requests are preempted and recomputed.
    settings = {"num_blocks": 21, "budget": 64, "max_model_len": 256}
    probe = make_engine(async_scheduling=False, **settings)
    ids = _mixed_run(probe, None)["r1"].outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])

    sync = make_engine(async_scheduling=False, **settings)
    expected = _mixed_run(sync, ids[stop_at])
    engine = make_engine(**settings)
    got = _mixed_run(engine, ids[stop_at])
    assert sync.scheduler.num_preemptions > 0
    assert engine.scheduler.num_preemptions > 0
    assert sorted(got) == sorted(expected) == ["p", "q", "r0", "r1", "r2", "r3", "r4"]
    assert len(expected["r1"].outputs[0].token_ids) == stop_at + 1  # stopped at its stop token
    for request_id, want in expected.items():
        for have, ref in zip(got[request_id].outputs, want.outputs, strict=True):
            assert have.token_ids == ref.token_ids, request_id
            assert have.finish_reason == ref.finish_reason
            if ref.logprobs is not None:
                assert have.logprobs is not None
                for a, b in zip(have.logprobs, ref.logprobs, strict=True):
                    assert (a.token_id, a.rank, a.top_token_ids) == (
                        b.token_id,
                        b.rank,
                        b.top_token_ids,
                    )
                    assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
