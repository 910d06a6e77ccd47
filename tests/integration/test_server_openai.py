"""The official `openai` client against a real `kvfleet engine`: features, concurrency, aborts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

from .conftest import MAX_MODEL_LEN, MODEL, Server

pytestmark = pytest.mark.timeout(900)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_models_and_health(server: Server, client: OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL
    assert model.quantization is None  # (kvfleet's field: a quantized model's scheme)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    info = f'kvfleet:model_info{{dtype="float32",model_name="{MODEL}",quantization="none"}}'
    assert server.metrics()[info] == 1.0


def test_chat_and_completion_match_the_offline_engine(client: OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24
    )
    completion = client.completions.create(
        model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=24
    )
    llm = LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    (offline_chat,) = llm.chat(QUESTION, greedy)
    (offline_completion,) = llm.generate("The three primary colors are", greedy)
    assert chat.choices[0].message.content == offline_chat.outputs[0].text
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"
    assert completion.choices[0].text == offline_completion.outputs[0].text
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(offline_completion.outputs[0].token_ids)
    assert completion.usage.prompt_tokens == len(offline_completion.prompt_token_ids)


def test_streaming_equals_non_streaming_with_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens

    streamed_completion = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12, stream=True
        )
    )
    whole_completion = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12
    )
    assert streamed_completion == whole_completion.choices[0].text


def test_n_seed_stop_and_logprobs(client: OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "n": 2,
        "seed": 11,
        "temperature": 1.0,
    }
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text

    stopped = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, stop=["Paris"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in (stopped.choices[0].message.content or "")

    with_logprobs = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = with_logprobs.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    completion = client.completions.create(
        model=MODEL, prompt="The sky is", temperature=0, max_tokens=4, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert lp is not None
    assert lp.tokens is not None
    assert len(lp.tokens) == 4
    assert "".join(lp.tokens) == completion.choices[0].text


def test_64_concurrent_streams(server: Server) -> None:
    async def one(client: AsyncOpenAI, i: int) -> tuple[int, str | None, int]:
        max_tokens = 4 + i % 13
        stream = await client.completions.create(
            model=MODEL, prompt=f"Item {i}: the number {i * 7} is", max_tokens=max_tokens,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, tokens = None, -1
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return max_tokens, finish, tokens

    async def all_of_them() -> list[tuple[int, str | None, int]]:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert all(
        finish == "length" and tokens == max_tokens for max_tokens, finish, tokens in results
    )
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnect_aborts_the_request_and_spares_the_others(server: Server) -> None:
    async def survivor() -> str | None:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        stream = await client.completions.create(
            model=MODEL, prompt="A long story:", max_tokens=60, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def quitter() -> None:
        body = {
            "model": MODEL,
            "prompt": "Count forever:",
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", f"{server.base_url}/completions", json=body) as response,
        ):
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream

    async def both() -> str | None:
        finish, _ = await asyncio.gather(survivor(), quitter())
        return finish

    assert asyncio.run(both()) == "length"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics[f'kvfleet:num_requests_running{{model_name="{MODEL}"}}'] == 0:
            break
        time.sleep(0.2)
    assert metrics[f'kvfleet:num_requests_running{{model_name="{MODEL}"}}'] == 0
    assert metrics[f'kvfleet:kv_cache_usage_perc{{model_name="{MODEL}"}}'] == 0.0
    assert (
        metrics[f'kvfleet:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}']
        >= 1
    )
    for kind in ("swap", "recompute"):  # (by kind, beside vLLM's num_preemptions: none here)
        name = f'kvfleet:preemptions_by_kind_total{{kind="{kind}",model_name="{MODEL}"}}'
        assert metrics[name] == 0


def test_kv_events_stream_and_snapshot(server: Server, client: OpenAI) -> None:
    document = " ".join(f"Fact {i}: the river crossed {i} valleys." for i in range(30))
    with httpx.Client(timeout=60) as http:
        with http.stream("GET", f"{server.url}/kv/events") as events:
            lines = events.iter_lines()
            assert next(lines) == "event: snapshot"
            snapshot = json.loads(next(lines).removeprefix("data: "))
            client.completions.create(model=MODEL, prompt=document, max_tokens=2, temperature=0)
            stored = []
            for line in lines:
                if line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    stored.append(event)
                    if len(stored) >= 5:
                        break
        assert [e["seq"] for e in stored] == list(range(snapshot["seq"] + 1, snapshot["seq"] + 6))
        assert all(
            e["type"] == "stored" and e["token_count"] == snapshot["block_size"] for e in stored
        )
        assert stored[1]["parent_hash"] == stored[0]["block_hash"]
        later = http.get(f"{server.url}/kv/snapshot").json()
        assert later["seq"] >= stored[-1]["seq"]
        assert {e["block_hash"] for e in stored} <= {b["block_hash"] for b in later["blocks"]}


def test_logit_bias_and_fields_that_change_nothing(client: OpenAI) -> None:
    """`logit_bias` steers sampling (+100 makes a token certain); OpenAI's bookkeeping fields
    (`user`, `metadata`, `store`) and fields sent as null are accepted and change nothing."""
    from kvfleet.engine.loader.source import resolve_model_source
    from kvfleet.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model_source(MODEL))
    target = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    biased = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0.8,
        logit_bias={str(target): 100},
    )
    assert biased.choices[0].text == tokenizer.decode([target] * 4)
    plain = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    same = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        user="someone",
        extra_body={"metadata": {"team": "a"}, "store": False, "response_format": None},
    )
    assert same.choices[0].text == plain.choices[0].text
