"""Issue 27: schemathesis over the published OpenAPI of a real engine and a real gateway in front
of it. Generated bodies, valid and not (schemathesis' positive and negative modes), 50 per
operation: no answer is a 5xx, the engine stays healthy and the gateway keeps its replica.

The engine serves a tiny random Llama with SmolLM2's tokenizer and chat template, so every
request generates in milliseconds whatever its `n` or `max_tokens`, and text prompts, chat
templating and stop strings run as with the real model."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.tokenizer import Tokenizer
from kvfleet.engine.worker.process import free_port
from kvfleet.gateway.app import GatewaySettings, create_gateway_app

from .conftest import Server, launch, stop_server
from .test_gateway_admission import serve

pytestmark = pytest.mark.timeout(900)
SERVED = "smollm2-tiny"
FUZZ = settings(
    max_examples=50,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run
)


def _tiny_model(folder: Path) -> Path:
    """A 2-layer Llama of width 32 with SmolLM2's tokenizer (its vocabulary and template)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.load(resolve_model_source("smollm2"))
    tokenizer.hf.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer.hf),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.hf.eos_token_id,
        bos_token_id=tokenizer.hf.bos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = _tiny_model(tmp_path_factory.mktemp("tiny-smollm2"))
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "engine", "--model", str(folder)]
    command += ["--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "128", "--num-blocks", "2048"]
    running = launch(
        tmp_path_factory.mktemp("fuzz-engine"),
        "engine",
        port,
        command,
        180,
        lambda server: httpx.get(f"{server.url}/health", timeout=2).status_code == 200,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def fuzz_gateway(fuzz_engine: Server) -> Iterator[str]:
    with serve(create_gateway_app(GatewaySettings(replicas=(fuzz_engine.url,)))) as url:
        yield url


def _fuzz(base_url: str, health_url: str, skip: tuple[str, ...] = ()) -> dict[str, list[int]]:
    """Every operation of the server's OpenAPI, up to FUZZ's examples each (operations with
    no input have one); the statuses answered, by operation."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    examples: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in skip:
            continue
        label = operation.label
        examples[label] = []

        @FUZZ
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            examples[label].append(_check(case, health_url))  # noqa: B023 (run right here)
            if isinstance(case.body, dict) and "model" in case.body:
                # again naming the served model: the rest of the body reaches the engine
                case.body = {**case.body, "model": SERVED}
                examples[label].append(_check(case, health_url))  # noqa: B023

        run()
    return examples


def _check(case: Any, health_url: str) -> int:
    response = case.call(timeout=60)
    body = response.text[:500]
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {body}"
    if response.status_code >= 400:
        assert "error" in json.loads(response.text), body  # the OpenAI error body
    health = httpx.get(health_url, timeout=30)
    assert health.status_code == 200, f"unhealthy after {case.method} {case.path}: {health.text}"
    return int(response.status_code)


def test_fuzzing_the_engine_gives_no_5xx(fuzz_engine: Server) -> None:
    # (/kv/events never ends: a stream of the engine's cache events)
    examples = _fuzz(fuzz_engine.url, f"{fuzz_engine.url}/health", skip=("/kv/events",))
    assert len(examples) == 10  # (GET and HEAD /health among them)
    posts = {label: s for label, s in examples.items() if label.startswith("POST")}
    assert len(posts) == 4
    assert min(len(s) for s in posts.values()) >= 50, examples
    for path in ("POST /v1/completions", "POST /v1/chat/completions"):  # both kinds answered
        assert 200 in posts[path], posts[path]
        assert any(400 <= s < 500 for s in posts[path]), posts[path]


def test_fuzzing_the_gateway_gives_no_5xx_and_keeps_its_replica(fuzz_gateway: str) -> None:
    # /health answers 503 as soon as no replica is in rotation
    examples = _fuzz(fuzz_gateway, f"{fuzz_gateway}/health")
    assert len(examples) == 9  # (GET and HEAD /health, the LoRA adapter routes among them)
    posts = {label: s for label, s in examples.items() if label.startswith("POST")}
    assert len(posts) == 4
    assert min(len(s) for s in posts.values()) >= 50, examples
    for path in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert 200 in posts[path], posts[path]  # forwarded and generated, and refused
        assert any(400 <= s < 500 for s in posts[path]), posts[path]
