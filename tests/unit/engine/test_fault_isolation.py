"""A step that fails is blamed on the request that makes it fail, found by running steps
without the others; the rest finish as if nothing happened."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.core.isolation import (
    MAX_CULPRITS_IN_A_ROW,
    EngineSickError,
    FaultIsolation,
)
from kvfleet.engine.core.request import RequestId
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

HfModelDir = Callable[[str], tuple[Any, Path]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _search(isolation: FaultIsolation, ids: list[RequestId], fails: Callable[[set], bool]) -> int:
    """Drive the search as the scheduler does: every step runs the window of suspects and
    the cleared requests; returns how many steps failed until no suspect is left."""
    cleared: set[RequestId] = set()
    failures = 0
    blamed = []
    unfinished = list(ids)
    in_step = set(ids)
    culprit = isolation.step_failed(unfinished, in_step)
    failures += 1
    for _ in range(10 * len(ids)):
        if not isolation.active:
            return failures
        window = set(isolation.suspects[: isolation.window])
        in_step = window | cleared
        if fails(in_step):
            failures += 1
            culprit = isolation.step_failed([r for r in unfinished if r not in cleared], in_step)
            if culprit is not None:
                blamed.append(culprit)
                unfinished.remove(culprit)
        else:
            isolation.step_passed(window)
            cleared |= window
    raise AssertionError(f"the search did not end; blamed {blamed}")


@pytest.mark.parametrize("position", [0, 5, 63, 127])
def test_the_search_blames_the_culprit_in_few_failed_steps(position: int) -> None:
    ids = [RequestId(f"r{i}") for i in range(128)]
    culprit = ids[position]
    isolation = FaultIsolation()
    blamed: list[RequestId] = []
    original = isolation.step_failed

    def record(unfinished: Any, in_step: Any) -> RequestId | None:
        found = original(unfinished, in_step)
        if found is not None:
            blamed.append(found)
        return found

    isolation.step_failed = record  # type: ignore[method-assign]
    failures = _search(isolation, ids, lambda step: culprit in step)
    assert blamed == [culprit]
    # the first failure, then halving 128 suspects down to one: log2(128) + 1 more
    assert failures <= 2 + math.ceil(math.log2(len(ids)))


def test_two_culprits_are_both_blamed() -> None:
    ids = [RequestId(f"r{i}") for i in range(16)]
    bad = {ids[3], ids[11]}
    isolation = FaultIsolation()
    _search(isolation, ids, lambda step: bool(bad & step))
    assert not isolation.active


def test_steps_that_fail_whatever_runs_mean_the_engine_is_sick() -> None:
    ids = [RequestId(f"r{i}") for i in range(16)]
    isolation = FaultIsolation()
    with pytest.raises(EngineSickError, match=f"{MAX_CULPRITS_IN_A_ROW} requests in a row"):
        _search(isolation, ids, lambda step: True)


def test_new_requests_wait_while_a_search_runs() -> None:
    isolation = FaultIsolation()
    a, b, new = RequestId("a"), RequestId("b"), RequestId("new")
    assert isolation.may_start(new)
    isolation.step_failed([a, b], {a, b})
    assert isolation.may_start(a)
    assert not isolation.may_start(b)
    assert not isolation.may_start(new)
    isolation.step_passed([a])
    isolation.forget([b])
    assert not isolation.active
    assert isolation.may_start(new)


# --- the engine --------------------------------------------------------------------------


def _engine(folder: Path, async_scheduling: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=256,
            cache=CacheConfig(block_size=16, num_blocks=128, enable_prefix_caching=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, async_scheduling=async_scheduling),
        )
    )


def _run(engine: LLMEngine) -> tuple[dict[str, RequestOutput], list[str], int]:
    """Step to the end the way AsyncEngine does: a step that raises is recovered from."""
    finished: dict[str, RequestOutput] = {}
    blamed: list[str] = []
    failures = 0
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            return finished, blamed, failures
        try:
            outputs = engine.step()
        except Exception:
            failures += 1
            blamed += engine.recover_from_failed_step()
            continue
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError("the engine did not finish its requests")


def _poisoned() -> SamplingParams:
    """Parameters that passed validation, then changed: top_k no longer fits its tensor, so
    the step that samples for the request raises (the defect the validation now stops)."""
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=12, seed=1, ignore_eos=True)
    params.top_k = 10**30
    return params


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_poisoned_request_fails_alone_and_its_batch_mates_finish_unchanged(
    hf_model_dir: HfModelDir, async_scheduling: bool
) -> None:
    _, folder = hf_model_dir("llama2-tied")
    prompts = {f"r{i}": [3 + (7 * i + 5 * j) % 380 for j in range(20 + 9 * i)] for i in range(4)}

    clean = _engine(folder, async_scheduling)
    for rid, prompt in prompts.items():
        clean.add_request(rid, prompt, PARAMS)
    expected, _, _ = _run(clean)

    engine = _engine(folder, async_scheduling)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    for _ in range(4):  # the four are decoding, their first tokens delivered
        engine.step()
    engine.add_request("poison", list(range(3, 40)), _poisoned())
    finished, blamed, failures = _run(engine)

    assert blamed == ["poison"]
    assert 2 <= failures <= 4  # the first, then the poison alone (with at most one halving)
    assert sorted(finished) == sorted(prompts)
    for rid, output in finished.items():
        assert output.outputs[0].token_ids == expected[rid].outputs[0].token_ids, rid
        assert output.outputs[0].finish_reason == "length"
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.scheduler.isolation.active
    # the engine serves on: a request after the search runs as any other
    engine.add_request("after", prompts["r0"], PARAMS)
    after, blamed, failures = _run(engine)
    assert (blamed, failures) == ([], 0)
    assert after["after"].outputs[0].token_ids == expected["r0"].outputs[0].token_ids


def test_a_request_that_breaks_scheduling_is_blamed(hf_model_dir: HfModelDir) -> None:
    """A failure while a waiting request is being admitted (its blocks hashed) is its own,
    though it never ran: the search starts with it."""
    _, folder = hf_model_dir("llama2-tied")
    prompts = {f"r{i}": [3 + (5 * i + 3 * j) % 380 for j in range(18 + 5 * i)] for i in range(3)}
    clean = _engine(folder, async_scheduling=True)
    for rid, prompt in prompts.items():
        clean.add_request(rid, prompt, PARAMS)
    expected, _, _ = _run(clean)

    engine = _engine(folder, async_scheduling=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    engine.step()
    engine.add_request("salty", list(range(3, 40)), PARAMS, cache_salt="fine")
    # changed after validation: hashing its blocks for the prefix cache raises
    engine.scheduler.requests[RequestId("salty")].cache_salt = "\ud800"
    finished, blamed, failures = _run(engine)
    assert blamed == ["salty"]
    assert failures == 2  # the first, then it alone
    assert {r: o.outputs[0].token_ids for r, o in finished.items()} == {
        r: o.outputs[0].token_ids for r, o in expected.items()
    }
