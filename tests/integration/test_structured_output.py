"""Structured output with the official `openai` client against `kvfleet serve` (the gateway in
front of a SmolLM2 engine): `.parse()` with a pydantic model, 50 generated JSON schemas whose
outputs validate with `jsonschema`, regex and choice, streaming, bad constraints refused with
400, and a slow grammar that stalls nobody else. Tool calls (Hermes format) and reasoning
(`<think>`) in tests/integration/test_tool_calls.py, on the same server."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from kvfleet.bench.structured import large_schema

from .conftest import MODEL, Server

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def client(served: Server) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


class City(BaseModel):
    name: str
    country: str
    population: int
    landmarks: list[str] = Field(max_length=3)  # (a small model may list forever)


def test_parse_returns_a_valid_object(client: OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Describe Paris as JSON with its name, country, population, landmarks."),
        response_format=City,
        temperature=0,
        max_tokens=300,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content


def generated_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random bounded schema: nested objects, arrays, enums, required and optional
    properties, numbers with bounds, string patterns."""
    low = rng.randint(-50, 50)
    patterns = ["^[A-Z]{2}-[0-9]{3}$", "^[a-z]{1,8}@[a-z]{1,8}\\.com$", "^#[0-9a-f]{6}$"]
    words = ["red", "green", "blue", "small", "large", "yes", "no"]
    leaves = {
        "string": lambda: {"type": "string", "maxLength": rng.randint(3, 16)},
        "pattern": lambda: {"type": "string", "pattern": rng.choice(patterns)},
        "integer": lambda: {
            "type": "integer",
            "minimum": low,
            "maximum": low + rng.randint(1, 500),
        },
        "number": lambda: {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])},
        "boolean": lambda: {"type": "boolean"},
        "enum": lambda: {"enum": rng.sample(words, 3)},
        "array": lambda: {
            "type": "array",
            "items": generated_schema(rng, depth + 1),
            "maxItems": 3,
        },
    }
    kind = rng.choice([*leaves, *(["object"] if depth < 2 else [])])
    if kind != "object":
        return leaves[kind]()
    keys = ["id", "name", "size", "color", "tags", "owner", "score", "code", "meta"]
    names = rng.sample(keys, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {name: generated_schema(rng, depth + 1) for name in names},
        "required": names[: rng.randint(1, len(names))],
        "additionalProperties": False,
    }


def test_fifty_generated_schemas_each_validate(served: Server) -> None:
    rng = random.Random(29)
    schemas = []
    while len(schemas) < 50:
        schema = generated_schema(rng)
        if schema.get("type") == "object":
            schemas.append(schema)

    async def one(client: AsyncOpenAI, i: int, schema: dict[str, Any]) -> tuple[str, str | None]:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=ask("Fill in this JSON object with sensible values."),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema{i}", "schema": schema, "strict": True},
            },
            temperature=0.7,
            seed=i,
            max_tokens=400,
        )
        choice = completion.choices[0]
        return choice.message.content or "", choice.finish_reason

    async def all_of_them() -> list[tuple[str, str | None]]:
        async with AsyncOpenAI(
            base_url=served.base_url, api_key="unused", max_retries=0, timeout=600
        ) as client:
            return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(schemas)))

    results = asyncio.run(all_of_them())
    cut = [(s, c) for s, (c, reason) in zip(schemas, results, strict=True) if reason != "stop"]
    assert not cut, [(len(cut), repr(c[-300:])) for _, c in cut]
    for schema, (content, _) in zip(schemas, results, strict=True):
        jsonschema.validate(json.loads(content), schema)


def test_regex_choice_and_grammar_outputs_match(client: OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="A licence plate:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", completion.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ask("Is the sky blue?"),
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    grammar = client.completions.create(
        model=MODEL,
        prompt="Some letters:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "<" [a-e]+ ">"'},
    )
    assert re.fullmatch("<[a-e]+>", grammar.choices[0].text)
    plain = client.chat.completions.create(
        model=MODEL,
        messages=ask('Reply with the JSON object {"ok": true} only.'),
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(plain.choices[0].message.content or ""), dict)


def test_streamed_json_equals_the_whole_answer(client: OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ask("Describe Rome as JSON with its name, country, population, landmarks."),
        "temperature": 0,
        "max_tokens": 300,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "City", "schema": City.model_json_schema()},
        },
    }
    whole = client.chat.completions.create(**request)
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**request, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content
    City.model_validate_json("".join(pieces))


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "cannot be compiled",
        ),
        ({"structured_outputs": {"regex": "([a"}}, "the regex cannot be compiled"),
        ({"guided_grammar": "root ::= nothing"}, "the grammar cannot be compiled"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint at a time"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos cannot"),
    ],
)
def test_bad_constraints_are_refused(served: Server, extra: dict[str, Any], reason: str) -> None:
    body = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 5, **extra}
    response = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
    ok = httpx.post(
        f"{served.base_url}/chat/completions",
        json={"model": MODEL, "messages": ask("Hi"), "max_tokens": 2},
        timeout=120,
    )
    assert ok.status_code == 200


def test_a_slow_grammar_stalls_nobody_else(client: OpenAI) -> None:
    # A schema of 150 objects with patterned fields compiles for a second or more (bench
    # structured reports it); a plain request sent meanwhile is answered before it.
    large = large_schema()
    client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=2)  # (warm)
    done: dict[str, float] = {}
    began = time.monotonic()

    def constrained() -> None:
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Fill in the form."),
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": large},
            },
        )
        done["large"] = time.monotonic() - began

    thread = threading.Thread(target=constrained)
    thread.start()
    time.sleep(0.2)
    client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=2)
    done["plain"] = time.monotonic() - began
    thread.join(300)
    assert done["plain"] < done["large"], done
