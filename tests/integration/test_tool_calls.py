"""Tool calling and reasoning with the official `openai` client through `kvfleet serve` (the
gateway in front of SmolLM2, Hermes tool-call format, Qwen3-style reasoning): a required or a
named call comes back parsed with arguments that validate against the function's schema,
streamed deltas reassemble to the whole reply, a conversation carrying calls and their results
renders, and bad tools are refused with 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI

from .conftest import MODEL, Server

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(900)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def client(served: Server) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


def test_a_required_call_comes_back_parsed_and_valid(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        parallel_tool_calls=False, max_tokens=200,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parallel_calls_each_validate(client: OpenAI) -> None:
    # (several calls may follow one another; a small model may go on calling until the
    # tokens run out: every complete call is returned, the cut one stays content)
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.7, seed=1,
        max_tokens=150,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_call(client: OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0.8, seed=3, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    assert named.choices[0].finish_reason == "tool_calls"
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_streamed_tool_calls_reassemble_to_the_whole_reply(client: OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
        "temperature": 0.7, "seed": 1, "max_tokens": 150,
    }  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason
    assert whole.message.tool_calls
    assert (content or None) == whole.message.content
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or []
    ]


def test_a_conversation_with_calls_and_results_renders(client: OpenAI) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    completion = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=20, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 40


def test_reasoning_comes_apart_whole_and_streamed(client: OpenAI) -> None:
    # (SmolLM2 does not think by itself: a regex makes it write the Qwen3 shape)
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"guided_regex": "<think>[a-z ]{5,40}</think>\\n\\nThe answer is [0-9]"},
    }
    whole = client.chat.completions.create(**request).choices[0].message
    reasoning = getattr(whole, "reasoning_content", None)
    assert reasoning
    assert "<think>" not in reasoning
    assert (whole.content or "").startswith("The answer is")
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            for key in streamed:
                streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning, "content": whole.content}


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "nonsense"}},
                    }
                ],
                "tool_choice": "required",
            },
            "cannot be compiled",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "same name"),
    ],
)
def test_bad_tools_are_refused(served: Server, extra: dict[str, Any], reason: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "tools": TOOLS, **extra}
    response = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
