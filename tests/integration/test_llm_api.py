"""The offline API on SmolLM2: chat, stops, logprobs, n, and what RequestOutput carries."""

from __future__ import annotations

import math

import pytest

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", max_model_len=1024, num_blocks=256)


def test_chat_answers_and_stops_at_eos(llm: LLM) -> None:
    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40))
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"
    assert completion.stop_reason is None
    assert completion.token_ids[-1] == llm.engine.eos_token_id
    assert "<|im_end|>" not in completion.text
    assert out.prompt_token_ids[:1] == [1]  # <|im_start|> opens the template


def test_stop_string_ends_text_before_it(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    (out,) = llm.chat(QUESTION, params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == "Paris"
    assert "Paris" not in completion.text
    assert completion.text.startswith("The capital of France is")


def test_stop_token_ids_and_length(llm: LLM) -> None:
    (greedy,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40))
    stop_id = greedy.outputs[0].token_ids[2]
    (stopped,) = llm.chat(
        QUESTION, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])
    )
    assert stopped.outputs[0].token_ids == greedy.outputs[0].token_ids[:3]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop_id)
    (short,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=2))
    assert short.outputs[0].finish_reason == "length"
    assert len(short.outputs[0].token_ids) == 2


def test_logprobs(llm: LLM) -> None:
    (out,) = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    )
    completion = out.outputs[0]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == 5
    for token_id, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert lp.token_id == token_id
        assert lp.rank == 1  # greedy picks the most likely token
        assert lp.top_token_ids[0] == token_id
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert completion.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in completion.logprobs)
    )
    assert math.exp(completion.logprobs[0].logprob) <= 1


def test_batch_keeps_order_and_params(llm: LLM) -> None:
    prompts = ["One, two, three,", "The sky is", "def add(a, b):"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 7)]
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5, 7]
    (sampled,) = llm.generate(
        "Once upon a time", SamplingParams(temperature=0.8, max_tokens=8, n=2, seed=1)
    )
    assert len(sampled.outputs) == 2
