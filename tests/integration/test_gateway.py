"""The gateway in front of two real SmolLM2 engines, driven by the official `openai` client.

Same answers through the gateway as from an engine directly (chat, completions, streaming,
usage); requests sharing a long prefix follow the replica that holds it; API keys and bad input
get OpenAI error bodies.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvfleet.gateway.admission.keys import hash_key

from .conftest import MODEL, Server, end_process, free_port, launch, start_server, stop_server

pytestmark = pytest.mark.timeout(900)
REPLICA_HEADER = "x-kvfleet-replica"


def start_gateway(tmp_path: Path, replicas: list[Server], *extra: str) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "gateway", "--host", "127.0.0.1"]
    command += ["--port", str(port), *extra]
    for replica in replicas:
        command += ["--replica", replica.url]

    def ready(gateway: Server) -> bool:
        healthy = httpx.get(f"{gateway.url}/health", timeout=2).status_code == 200
        return healthy and bool(httpx.get(f"{gateway.base_url}/models", timeout=2).json()["data"])

    return launch(tmp_path, "gateway", port, command, 60, ready)


def stop_gateway(gateway: Server) -> None:
    end_process(gateway, 30)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    started = [start_server(tmp_path_factory.mktemp(f"replica-{i}")) for i in range(2)]
    yield started
    for engine in started:
        stop_server(engine)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, engines: list[Server]) -> Iterator[Server]:
    running = start_gateway(tmp_path_factory.mktemp("gateway"), engines)
    yield running
    stop_gateway(running)


def _client(server: Server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def test_same_answers_as_an_engine_directly(gateway: Server, engines: list[Server]) -> None:
    direct, through = _client(engines[0]), _client(gateway)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a primary colour."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    a, b = direct.chat.completions.create(**chat), through.chat.completions.create(**chat)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage == a.usage
    assert httpx.head(f"{gateway.url}/health").status_code == 200  # (probes may use HEAD)
    completion = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0}
    a2, b2 = direct.completions.create(**completion), through.completions.create(**completion)
    assert b2.choices[0].text == a2.choices[0].text
    assert b2.usage == a2.usage
    streamed = through.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == a.choices[0].message.content
    assert usage == a.usage
    listed = [m.id for m in through.models.list().data]
    assert listed == [MODEL]


def test_requests_sharing_a_prefix_follow_the_replica_holding_it(
    gateway: Server, engines: list[Server]
) -> None:
    # A new document goes to the replica its first block hashes to (rendezvous hashing over
    # the replicas' URLs, which take free ports): the groups are chosen so that two land on
    # each replica, which the gateway's first choices must then match exactly.
    first_replica = _rendezvous_choices(engines)
    groups: dict[str, str] = {}
    wanted = {engine.url: 2 for engine in engines}
    for name in (f"doc{i}" for i in range(64)):
        document = f"Document {name}: " + " ".join(f"{name}w{i}" for i in range(300))
        target = first_replica(f"{document}\nQ0:")
        if wanted[target]:
            wanted[target] -= 1
            groups[name] = document
        if len(groups) == 4:
            break
    served: dict[str, list[str]] = {name: [] for name in groups}
    with httpx.Client(timeout=120) as client:
        for round_ in range(4):
            for name, document in groups.items():
                response = client.post(
                    f"{gateway.base_url}/completions",
                    json={"model": MODEL, "prompt": f"{document}\nQ{round_}:", "max_tokens": 1},
                )
                assert response.status_code == 200, response.text
                served[name].append(response.headers[REPLICA_HEADER])
                time.sleep(0.3)  # let the engine's KV events reach the gateway
    followed = sum(r == s[0] for s in served.values() for r in s[1:])
    assert followed >= 0.9 * sum(len(s) - 1 for s in served.values()), served
    assert {name: s[0] for name, s in served.items()} == {
        name: first_replica(f"{document}\nQ0:") for name, document in groups.items()
    }  # (so the groups spread over both replicas)


def _rendezvous_choices(engines: list[Server]) -> Callable[[str], str]:
    """The replica an idle gateway picks for a prompt no replica holds yet."""
    import hashlib

    from kvfleet.engine.protocol.kv import extra_keys_for, hash_full_blocks
    from kvfleet.gateway.tokenizer import GatewayTokenizer

    info = httpx.get(f"{engines[0].url}/tokenizer", timeout=30).json()
    tokenizer = GatewayTokenizer(
        info["tokenizer"], info.get("chat_template"), info["special_tokens"], info["block_size"]
    )

    def choice(prompt: str) -> str:
        ids = tokenizer.encode(prompt)
        first = next(iter(hash_full_blocks(ids, info["block_size"], extra_keys_for(None, None))))
        return max(
            (engine.url for engine in engines),
            key=lambda url: hashlib.sha256(f"{first.hex()}\x00{url}".encode()).digest(),
        )

    return choice


def test_keys_and_bad_input(tmp_path: Path, engines: list[Server]) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [{"id": "team", "sha256": hash_key("s3cret"), "requests_per_min": 2}]})
    )
    gateway = start_gateway(tmp_path, engines, "--api-keys", str(keys))
    try:
        url = f"{gateway.base_url}/completions"
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        for _ in range(2):
            assert httpx.post(url, json=body, headers=good, timeout=60).status_code == 200
        limited = httpx.post(url, json=body, headers=good, timeout=60)
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        cases = [
            (b'{"model": ', 400, "not valid JSON"),
            (json.dumps({**body, "model": "nope"}).encode(), 404, "does not exist"),
            (b"x" * (9 << 20), 413, "larger than"),
        ]
        for raw, status, message in cases:
            response = httpx.post(url, content=raw, headers=good, timeout=60)
            assert response.status_code == status, response.text
            assert message in response.json()["error"]["message"]
    finally:
        stop_gateway(gateway)


def test_a_second_gateway_routes_the_same_requests_the_same_way(
    tmp_path: Path, gateway: Server, engines: list[Server]
) -> None:
    with httpx.Client(timeout=120) as client:

        def ask(server: Server, document: str, question: int) -> str:
            response = client.post(
                f"{server.base_url}/completions",
                json={"model": MODEL, "prompt": f"{document}\nQ{question}:", "max_tokens": 1},
            )
            assert response.status_code == 200, response.text
            return response.headers[REPLICA_HEADER]

        # Place documents until there are 6 and both replicas hold some: a new document goes
        # where its first block hashes among the replica ids, whose ports change run to run
        # (with 6 fixed documents, all on one replica 1 run in 32).
        documents: list[str] = []
        placed: list[str] = []
        while len(documents) < 6 or (len(set(placed)) < 2 and len(documents) < 24):
            n = len(documents)
            documents.append(f"Report {n}: " + " ".join(f"r{n}w{i}" for i in range(200)))
            placed.append(ask(gateway, documents[-1], 0))
        time.sleep(1.0)  # KV events reach the gateways
        first = [ask(gateway, d, 1) for d in documents]
        second_gateway = start_gateway(tmp_path, engines)  # a fresh one: snapshots only
        try:
            time.sleep(1.0)
            second = [ask(second_gateway, d, 2) for d in documents]
        finally:
            stop_gateway(second_gateway)
    assert second == first
    assert len(set(first)) == 2  # the documents are on both replicas
