"""Bad input gets the documented status and OpenAI error body, and the server keeps serving;
/metrics counts what happened; /health says "loading" until the model is ready."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvfleet.engine.config import CacheConfig, EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.server.app import ServerSettings, create_app

from .conftest import MODEL, Server, free_port

pytestmark = pytest.mark.timeout(600)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hello"}
LONG_TEXT = "lighthouse keeper " * 1100  # ~2,200 tokens, over the 2,048 context


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("chat/completions", b'{"model": "smollm2", "messages": [', 400, "not valid JSON"),
        ("chat/completions", b"[1, 2]", 400, "must be a JSON object"),
        ("chat/completions", b'{"model": "smollm2", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        ("chat/completions", {"model": MODEL}, 400, "messages: Field required"),
        ("completions", {"model": MODEL}, 400, "prompt: Field required"),
        ("completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
        ("chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
        ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        (
            "chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "role",
        ),
        ("chat/completions", {**CHAT, "model": "gpt-9"}, 404, "does not exist"),
        ("completions", {**COMPLETION, "prompt": LONG_TEXT}, 400, "maximum context length is 2048"),
        ("completions", {**COMPLETION, "max_tokens": 5000}, 400, "maximum context length is 2048"),
        ("completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
        ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
        ("completions", {**COMPLETION, "n": 129}, 400, "n"),
        ("completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs"),
        ("completions", {**COMPLETION, "stop": 5}, 400, "stop"),
        ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt is empty"),
        ("completions", {**COMPLETION, "prompt": [999999]}, 400, "out of range"),
        # a field kvfleet does not implement is refused, never ignored (issue 29)
        (
            "chat/completions",
            {**CHAT, "functions": [{"name": "f"}]},
            400,
            "functions: kvfleet does not support this field",
        ),
        (
            "chat/completions",
            {**CHAT, "response_format": {"type": "json_schema"}},
            400,
            "response_format: json_schema needs its json_schema object",
        ),
        ("completions", {**COMPLETION, "suffix": "!"}, 400, "suffix: kvfleet does not support"),
        ("completions", {**COMPLETION, "logit_bias": {"a": 1}}, 400, "keys must be token ids"),
        ("completions", {**COMPLETION, "logit_bias": {"999999": 5}}, 400, "out of range"),
        (
            "completions",
            b'{"model": "smollm2", "prompt": "' + b"x" * (10 << 20) + b'"}',
            413,
            "larger than",
        ),
    ],
)
def test_bad_input_gets_an_openai_error(
    server: Server, path: str, body: Any, status: int, message: str
) -> None:
    url = f"{server.base_url}/{path}"
    if isinstance(body, bytes):
        response = httpx.post(
            url, content=body, headers={"content-type": "application/json"}, timeout=60
        )
    else:
        response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    # ... and the server keeps serving.
    ok = httpx.post(
        f"{server.base_url}/completions", json={**COMPLETION, "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_metrics_count_what_happened(server: Server) -> None:
    label = f'model_name="{MODEL}"'

    def read() -> dict[str, float]:
        return server.metrics()

    before = read()
    prompt = list(range(1000, 1010))
    for _ in range(3):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
        assert (
            httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
        )
    after = read()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"kvfleet:prompt_tokens_total{{{label}}}") == 30
    assert delta(f"kvfleet:generation_tokens_total{{{label}}}") == 15
    assert delta(f'kvfleet:request_success_total{{finished_reason="length",{label}}}') == 3
    assert delta(f"kvfleet:time_to_first_token_seconds_count{{{label}}}") == 3
    assert delta(f"kvfleet:e2e_request_latency_seconds_count{{{label}}}") == 3
    assert delta(f"kvfleet:request_queue_time_seconds_count{{{label}}}") == 3
    assert delta(f"kvfleet:inter_token_latency_seconds_count{{{label}}}") == 3 * 4
    assert delta(f"kvfleet:prefix_cache_queries_total{{{label}}}") == 30
    # The same 10-token prompt: blocks of 16 never fill, so nothing is cached or hit.
    assert delta(f"kvfleet:prefix_cache_hits_total{{{label}}}") == 0
    assert after[f"kvfleet:num_requests_running{{{label}}}"] == 0
    assert after[f"kvfleet:kv_cache_usage_perc{{{label}}}"] == 0.0


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an app with uvicorn in a thread on a free loopback port; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def wait_healthy(url: str) -> None:
    for _ in range(400):
        if httpx.get(f"{url}/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


def tiny_config(folder: Path) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        enable_kv_events=True,
        cache=CacheConfig(num_blocks=64),
    )


def test_health_is_503_while_loading_and_vllm_names(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
) -> None:
    _, folder = hf_model_dir("llama2-tied")
    release = threading.Event()

    def slow_factory(config: EngineConfig) -> LLMEngine:
        release.wait(60)
        return LLMEngine(config)

    settings = ServerSettings(
        engine=tiny_config(folder), served_model_name="tiny", metrics_compat="vllm"
    )
    with serve_in_thread(create_app(settings, slow_factory)) as url:
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        assert httpx.head(f"{url}/health").status_code == 503  # (probes may use HEAD)
        early = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6]})
        assert early.status_code == 503
        assert early.json()["error"]["type"] == "service_unavailable"

        release.set()
        wait_healthy(url)
        assert httpx.head(f"{url}/health").status_code == 200
        ok = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3}
        )
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 3
        text_prompt = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "words"})
        assert text_prompt.status_code == 400
        assert "no tokenizer" in text_prompt.json()["error"]["message"]
        no_tokenizer = httpx.get(f"{url}/tokenizer")
        assert no_tokenizer.status_code == 404
        assert no_tokenizer.json()["error"]["code"] == "no_tokenizer"
        load = {"lora_name": "a", "lora_path": str(folder)}
        no_lora = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
        assert no_lora.status_code == 400
        assert "enable_lora" in no_lora.json()["error"]["message"]
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert unload.status_code == 404
        metrics = httpx.get(f"{url}/metrics").text
        assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics
        assert 'kvfleet:generation_tokens_total{model_name="tiny"} 3.0' in metrics
        assert 'vllm:generation_tokens_total{model_name="tiny"} 3.0' in metrics


def test_a_request_that_fails_its_steps_fails_alone(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
) -> None:
    """Defect 1 of issue 27: a poisoned request in a batch of five fails alone (400: its
    fault, not the replica's); its four batch mates get what they get without it."""
    _, folder = hf_model_dir("llama2-tied")
    mode = {"fail": True}
    go = threading.Event()
    poison = [6, 6, 6, 6]

    def flaky_factory(config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(config)
        real_step, real_launch = engine.step, engine.runner.launch

        def step() -> list[Any]:
            if mode.pop("fail", False):
                raise RuntimeError("injected transient failure")
            return real_step()

        def launch(scheduler_output: Any, **options: Any) -> Any:
            go.wait(60)  # after scheduling: the scheduled request is running, not waiting
            requests = engine.scheduler.requests
            if any(
                requests[r].prompt_token_ids == poison
                for r in scheduler_output.num_scheduled_tokens
                if r in requests
            ):
                raise RuntimeError("injected failure")
            return real_launch(scheduler_output, **options)

        engine.step = step  # type: ignore[method-assign]
        engine.runner.launch = launch  # type: ignore[method-assign]
        return engine

    def complete(prompt: list[int]) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    settings = ServerSettings(engine=tiny_config(folder), served_model_name="tiny")
    prompts = [[5 + i, 9, 11 + 2 * i, 4] for i in range(4)]
    with serve_in_thread(create_app(settings, flaky_factory)) as url:
        wait_healthy(url)
        go.set()
        recovered = complete(prompts[0])  # the first step fails once: it runs again
        assert recovered.status_code == 200, recovered.text
        alone = [complete(prompt).json()["choices"][0]["text"] for prompt in prompts]

        go.clear()  # the five arrive while a step holds: the next one runs them together
        with ThreadPoolExecutor(5) as pool:
            sent = pool.map(complete, [*prompts[:2], poison, *prompts[2:]])
            for _ in range(200):
                load = httpx.get(f"{url}/metrics").text
                if _gauge(load, "num_requests_running") + _gauge(load, "num_requests_waiting") == 5:
                    break
                time.sleep(0.05)
            go.set()
            answers = list(sent)
        bad = answers.pop(2)
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_failed")
        assert "injected failure" in error["message"]
        assert [a.status_code for a in answers] == [200] * 4
        assert [a.json()["choices"][0]["text"] for a in answers] == alone
        assert httpx.get(f"{url}/health").status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvfleet:requests_isolated_total{model_name="tiny"} 1.0' in metrics
        assert complete(prompts[1]).json()["choices"][0]["text"] == alone[1]


def _gauge(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(f"kvfleet:{name}{{"))
    return float(line.rpartition(" ")[2])


def test_overload_is_503(hf_model_dir: Callable[[str], tuple[Any, Path]]) -> None:
    _, folder = hf_model_dir("llama2-tied")
    go = threading.Event()

    def blocking_factory(config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(config)
        real_launch = engine.runner.launch

        def launch(scheduler_output: Any, **options: Any) -> Any:
            go.wait(60)  # after scheduling: the scheduled request is running, not waiting
            return real_launch(scheduler_output, **options)

        engine.runner.launch = launch  # type: ignore[method-assign]
        return engine

    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
    settings = ServerSettings(
        engine=tiny_config(folder), served_model_name="tiny", max_waiting_requests=1
    )
    with serve_in_thread(create_app(settings, blocking_factory)) as url:
        wait_healthy(url)
        # Steps block until `go`: one request runs, the next waits, the third is refused.
        results: list[int] = []
        senders = [
            threading.Thread(
                target=lambda: results.append(
                    httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
                )
            )
            for _ in range(2)
        ]
        for sender in senders:
            sender.start()
            time.sleep(0.3)
        for _ in range(100):
            if (
                'kvfleet:num_requests_waiting{model_name="tiny"} 1.0'
                in httpx.get(f"{url}/metrics").text
            ):
                break
            time.sleep(0.05)
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "overloaded"
        go.set()
        for sender in senders:
            sender.join(60)
        assert results == [200, 200]
