"""Hostile request bodies (issue 27, defects 1 and 2): values that cannot become tensors, text
that is no Unicode, pathological nesting. The engine and the gateway answer 400 with the OpenAI
error body, before any of it reaches a batch (the gateway forwards nothing), and keep serving."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from kvfleet.bench.fake_engine import MODEL as FAKE_MODEL
from kvfleet.bench.fake_engine import fake_engine
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.server.app import ServerSettings, create_app
from kvfleet.gateway.admission.keys import KeyStore, hash_key
from kvfleet.gateway.admission.rate_limit import KeyLimits
from kvfleet.gateway.app import GatewaySettings, create_gateway_app
from kvfleet.gateway.proxy import REPLICA_HEADER
from kvfleet.gateway.routing.snapshot import Policy

from .conftest import MODEL, Server
from .test_gateway_admission import serve

pytestmark = pytest.mark.timeout(300)


def hostile(model: str) -> list[tuple[str, bytes, str]]:
    """(path, raw body, what the 400 names) for the bodies seen to break the stack."""
    completion = {"model": model, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def body(base: dict[str, Any], **fields: Any) -> bytes:
        return json.dumps({**base, **fields}).encode()

    nested = b'{"model": "%s", "prompt": ' % model.encode() + b"[" * 100_000 + b"]" * 100_000
    return [
        ("completions", body(completion, top_k=10**30), "top_k"),
        ("completions", body(completion, seed=2**70), "seed"),
        ("completions", body(completion, temperature=float("inf")), "temperature"),
        ("completions", body(completion, max_tokens=2**64), "max_tokens"),
        ("completions", body(completion, stop_token_ids=[2**64]), "stop_token_ids"),
        ("completions", body(completion, prompt=[1, -1]), "prompt"),
        ("completions", body(completion, prompt=[2**64]), "prompt"),
        ("completions", body(completion, cache_salt="\ud800"), "not valid Unicode"),
        (
            "chat/completions",
            body(chat, messages=[{"role": "user", "content": "a\udfff"}]),
            "not valid Unicode",
        ),
        ("completions", nested + b"}", "nested deeper than 64"),
        ("completions", body(completion, stop=["x"] * 1000), "stop"),
    ]


CASES = hostile("MODEL")


def _post(url: str, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=raw, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("index"), range(len(CASES)), ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)]
)
def test_the_engine_refuses_and_keeps_serving(server: Server, index: int) -> None:
    path, raw, names = hostile(MODEL)[index]
    response = _post(f"{server.base_url}/{path}", raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert names in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = httpx.post(
        f"{server.base_url}/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_the_gateway_refuses_before_forwarding() -> None:
    forwarded: list[bytes] = []
    engine = fake_engine()

    @engine.middleware("http")
    async def record(request: Any, call_next: Any) -> Any:
        if request.url.path.startswith("/v1/") and request.method == "POST":
            forwarded.append(await request.body())
        return await call_next(request)

    with serve(engine) as engine_url:
        app = create_gateway_app(GatewaySettings(replicas=(engine_url,)))
        with serve(app) as gateway_url:
            for path, raw, names in hostile(FAKE_MODEL):
                response = _post(f"{gateway_url}/v1/{path}", raw)
                assert response.status_code == 400, (names, response.text)
                assert names in response.json()["error"]["message"]
            ok = httpx.post(
                f"{gateway_url}/v1/completions",
                json={"model": FAKE_MODEL, "prompt": "Hello", "max_tokens": 2},
                timeout=60,
            )
            assert ok.status_code == 200
    assert len(forwarded) == 1  # only the good request reached the engine


def test_batch_prompts_are_charged_every_token_they_can_cause() -> None:
    """Issue 27, defect 3: a streamed completions request with 20 prompts reserves all 20
    prompts and max_tokens for each, and is settled with all its prompts (it was charged its
    first prompt and the streamed chunks: 7 such requests passed 52,290 tokens in 58 s on a
    3,000 tokens/minute key)."""

    keys = KeyStore.from_mapping({"keys": [{"id": "tenant", "sha256": hash_key("tenant")}]})
    batch = [list(range(100)) for _ in range(20)]  # 20 prompts of 100 token ids
    body = {"model": FAKE_MODEL, "prompt": batch, "max_tokens": 16, "stream": True}
    with serve(fake_engine(chunk_delay_s=0.0)) as engine_url:
        settings = GatewaySettings(
            replicas=(engine_url,), keys=keys, default_limits=KeyLimits(tokens_per_min=3000)
        )
        with serve(create_gateway_app(settings)) as gateway_url:
            headers = {"authorization": "Bearer tenant"}
            statuses = []
            for _ in range(7):
                with httpx.stream(
                    "POST", f"{gateway_url}/v1/completions", json=body, headers=headers
                ) as response:
                    response.read()
                    statuses.append(response.status_code)
    # each reserves 20 x (100 + 16) = 2,320 tokens and uses at least its 2,000 prompt tokens:
    # one fits in 3,000 a minute, the next six do not
    assert statuses == [200] + [429] * 6


def test_a_tenant_cannot_raise_its_priority_above_its_key() -> None:
    """Issue 27, defect 4: `x-priority: -100` let one key's flood starve another. A key asks
    at most as urgent as its `max_priority` (default: its `priority`); lowering is allowed."""

    keys = KeyStore.from_mapping(
        {
            "keys": [
                {"id": "tenant", "sha256": hash_key("tenant")},
                {"id": "ops", "sha256": hash_key("ops"), "priority": 0, "max_priority": -10},
            ]
        }
    )
    body = {"model": FAKE_MODEL, "prompt": "Hello", "max_tokens": 2}
    with serve(fake_engine()) as engine_url:
        app = create_gateway_app(GatewaySettings(replicas=(engine_url,), keys=keys))
        with serve(app) as url:

            def post(key: str, extra: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
                return httpx.post(
                    f"{url}/v1/completions",
                    json={**body, **extra},
                    headers={"authorization": f"Bearer {key}", **headers},
                    timeout=30,
                )

            raised = post("tenant", {}, {"x-priority": "-100"})
            assert raised.status_code == 400
            assert "more urgent than this API key may ask for" in raised.json()["error"]["message"]
            assert post("tenant", {"priority": -100}, {}).status_code == 400  # the engine's field
            assert post("tenant", {}, {"x-priority": "5"}).status_code == 200  # less urgent: fine
            assert post("ops", {}, {"x-priority": "-10"}).status_code == 200  # its ceiling
            assert post("ops", {}, {"x-priority": "-11"}).status_code == 400


def test_the_published_openapi_declares_every_request_body() -> None:
    """Issue 27, defect 7: operations with bodies declare them (fuzzers and client generators
    saw empty operations), with the bounds the servers enforce, and no dangling references."""

    engine = create_app(ServerSettings(EngineConfig(model="smollm2"))).openapi()
    gateway = create_gateway_app(GatewaySettings(replicas=("http://127.0.0.1:9",))).openapi()
    for document, posts in (
        (engine, 4),
        (gateway, 4),  # (the LoRA adapter routes among them)
    ):
        operations = [
            operation
            for item in document["paths"].values()
            for method, operation in item.items()
            if method == "post"
        ]
        assert len(operations) == posts
        for operation in operations:
            schema = operation["requestBody"]["content"]["application/json"]["schema"]
            assert schema["type"] == "object"
            assert schema["required"]
            assert "$ref" not in json.dumps(schema)
    completions = gateway["paths"]["/v1/completions"]["post"]["requestBody"]
    properties = completions["content"]["application/json"]["schema"]["properties"]
    assert properties["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert "prompt" in properties


def _finished(server: Server, reason: str) -> float:
    label = f'kvfleet:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}'
    return server.metrics().get(label, 0.0)


def test_a_non_streaming_client_that_leaves_stops_its_request(server: Server) -> None:
    """Issue 27, defect 5: the request ran to its end (25 s more on CPU) holding KV blocks and
    a batch slot after its client disconnected. Now it ends aborted, not by its length."""
    aborted, ran_out = _finished(server, "abort"), _finished(server, "length")
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 120  # a bound on the wait, not a speed claim
    while _finished(server, "abort") == aborted and _finished(server, "length") == ran_out:
        assert time.monotonic() < deadline, "the request never finished"
        time.sleep(0.1)
    assert _finished(server, "abort") == aborted + 1
    assert _finished(server, "length") == ran_out


def test_the_gateway_abandons_a_whole_answer_whose_client_left() -> None:
    """The gateway drops its upstream request when its client leaves, so the engine sees the
    disconnect too (and aborts)."""
    left: list[float] = []

    async def never_done(request: Request) -> JSONResponse:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        left.append(time.monotonic())
        return JSONResponse({})

    engine = fake_engine()
    engine.router.routes.insert(0, APIRoute("/v1/completions", never_done, methods=["POST"]))
    limits = KeyLimits(tokens_per_min=100)
    with serve(engine) as engine_url:
        app = create_gateway_app(GatewaySettings(replicas=(engine_url,), default_limits=limits))
        with serve(app) as gateway_url:
            # "Hello" counts 5 (its bytes: no tokenizer) + 60 = 65 of the 100 a minute
            body = {"model": FAKE_MODEL, "prompt": "Hello", "max_tokens": 60}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=1.0)
            deadline = time.monotonic() + 60  # without the fix: never (the engine waits forever)
            while not left:
                assert time.monotonic() < deadline, "the gateway kept waiting for nobody"
                time.sleep(0.05)
            # leaving did not make it free: the same request no longer fits this minute
            again = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=5)
            assert again.status_code == 429


def _replica_that_fails(on: str, sick: dict[str, bool]) -> Any:
    """A fake engine answering 500 to completions whose prompt is `on` (a request it cannot
    serve), and to everything, health included, while `sick["now"]`."""
    engine = fake_engine()

    @engine.middleware("http")
    async def fail(request: Any, call_next: Any) -> Any:
        if sick["now"] and request.url.path in ("/health", "/v1/completions"):
            status = 503 if request.url.path == "/health" else 500
            return JSONResponse({"error": {"message": "sick"}}, status_code=status)
        if request.url.path == "/v1/completions" and on in (await request.body()).decode():
            return JSONResponse({"error": {"message": "cannot"}}, status_code=500)
        return await call_next(request)

    return engine


def test_one_requests_server_error_drains_no_replica() -> None:
    """Issue 27, defect 1 at the gateway: a replica answering 500 to one request was drained,
    the retry's replica too, leaving "no engine replica is ready". A 500 now makes the gateway
    check the replica's health at once: only a replica whose check fails leaves rotation."""
    sick = {"now": False}
    with (
        serve(_replica_that_fails("boom", sick)) as a_url,
        serve(_replica_that_fails("boom", {"now": False})) as b_url,
    ):
        # polls a minute apart: only the check after a 500 can change a replica's state
        settings = GatewaySettings(
            replicas=(a_url, b_url), poll_interval_s=60, policy=Policy.ROUND_ROBIN
        )
        with serve(create_gateway_app(settings)) as url:

            def post(prompt: str) -> httpx.Response:
                body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": 2}
                return httpx.post(f"{url}/v1/completions", json=body, timeout=30)

            boom = post("boom")  # both replicas answer it 500
            assert boom.status_code == 503
            assert "answered 500" in boom.json()["error"]["message"]
            served_by = {post("fine").headers[REPLICA_HEADER] for _ in range(6)}
            assert served_by == {a_url, b_url}  # both still in rotation

            sick["now"] = True  # now replica a is sick: its health check fails
            answers = [post("fine") for _ in range(6)]
            assert [a.status_code for a in answers] == [200] * 6
            assert {a.headers[REPLICA_HEADER] for a in answers} == {b_url}


def huge_chat(model: str) -> bytes:
    """100,000 one-word messages (~4 MB, under the 8 MiB limit)."""
    messages = [{"role": "user", "content": "word"}] * 100_000
    return json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()


def _health_answers_first(url: str, raw: bytes) -> list[str]:
    """The order in which a huge chat body and a /health probe sent once the body's last
    byte is out finish (no sleep: the probe follows the upload, not a clock)."""
    finished: list[str] = []
    uploaded = threading.Event()

    def body() -> Iterator[bytes]:
        for start in range(0, len(raw), 1 << 16):
            yield raw[start : start + (1 << 16)]
        uploaded.set()

    def send() -> None:
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        response = httpx.post(
            f"{url}/v1/chat/completions", content=body(), headers=headers, timeout=120
        )
        finished.append(f"chat {response.status_code}")

    sender = threading.Thread(target=send)
    sender.start()
    assert uploaded.wait(120), "the body was never sent"
    health = httpx.get(f"{url}/health", timeout=120)
    finished.append(f"health {health.status_code}")
    sender.join(120)
    return finished


def test_a_huge_body_is_worked_on_off_the_event_loop(server: Server) -> None:
    """Issue 27, defect 6: 100,000 messages stalled the engine's event loop 3-5 s (templating
    and tokenizing ran on it), and every other stream with it. Now /health, on the loop,
    answers while the body is still being worked on; the body gets its 400 after."""
    order = _health_answers_first(server.url, huge_chat(MODEL))
    assert order == ["health 200", "chat 400"]


def test_the_gateway_works_on_a_huge_body_off_its_event_loop() -> None:
    from kvfleet.engine.loader.source import resolve_model_source
    from kvfleet.engine.tokenizer import Tokenizer

    info = Tokenizer.load(resolve_model_source(MODEL)).info(FAKE_MODEL, 16).model_dump()
    with serve(fake_engine(tokenizer_info=info)) as engine_url:
        app = create_gateway_app(GatewaySettings(replicas=(engine_url,)))
        with serve(app) as gateway_url:
            # the gateway tokenizes it (for the key's token reservation), then forwards it
            order = _health_answers_first(gateway_url, huge_chat(FAKE_MODEL))
    assert order == ["health 200", "chat 200"]
