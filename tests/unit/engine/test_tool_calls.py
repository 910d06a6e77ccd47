"""Tool-call and reasoning parsers on recorded outputs in each supported format: text around
the calls, several calls, malformed calls (content, never an error), and streamed deltas that
reassemble to the whole reply's parse."""

from __future__ import annotations

import json

import pytest

from kvfleet.engine.structured.reasoning import StreamedReasoning, reasoning_parser
from kvfleet.engine.structured.tool_calls import (
    StreamedToolCalls,
    parser_for_template,
    tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, model output, expected content, expected calls as (name, arguments))
RECORDED = [
    (
        "hermes",  # Qwen2.5 / Qwen3: one call after some text
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "Let me check the weather.\n",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",  # two calls, no text
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"tz": "Europe/Paris"}}\n</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "hermes",  # a malformed block beside a good one stays in the content
        'Trying.\n<tool_call>{"name": "broken", "arguments": {"x": </tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        'Trying.\n<tool_call>{"name": "broken", "arguments": {"x": </tool_call>\n',
        [("get_time", {})],
    ),
    (
        "hermes",  # only malformed: the whole text is content
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        [],
    ),
    ("hermes", "The weather is fine today.", "The weather is fine today.", []),
    (
        "llama3_json",  # Llama 3.1: the reply is the call
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",  # several, joined by ";", after the python tag
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",  # arguments written as JSON text
        '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",  # JSON that is no call
        '{"answer": 42}',
        '{"answer": 42}',
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {',
        '{"name": "get_time", "parameters": {',
        [],
    ),
    (
        "mistral",  # v3: a JSON list after the control token
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        "Sure.",
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "mistral",  # v11: name[ARGS]{...} per call
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "mistral",  # cut off mid-list
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
]


@pytest.mark.parametrize(("name", "output", "content", "calls"), RECORDED)
def test_recorded_outputs_parse(name: str, output: str, content: str | None, calls: list) -> None:
    reply = tool_parser(name).parse(output)
    assert reply.content == content
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == calls
    assert len({c.id for c in reply.tool_calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in reply.tool_calls)


@pytest.mark.parametrize(("name", "output", "content", "calls"), RECORDED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_reassemble_to_the_whole_reply(
    name: str, output: str, content: str | None, calls: list, step: int
) -> None:
    stream = StreamedToolCalls(tool_parser(name))
    sent = "".join(stream.feed(output[:end]) for end in range(step, len(output), step))
    last, streamed_calls = stream.finish(output)
    assert ((sent + last) or None) == content
    assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls


def test_prose_streams_as_it_comes_and_a_call_is_held() -> None:
    stream = StreamedToolCalls(tool_parser("hermes"))
    assert stream.feed("Let me") == "Let me"
    assert stream.feed("Let me check <tool") == " check "  # ("<tool" may begin a call)
    assert stream.feed('Let me check <tool_call>{"name"') == ""
    assert stream.feed('Let me check <tool_call>{"name": "f"}</tool_call> ok') == ""


def test_the_parser_follows_the_chat_template() -> None:
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] [TOOL_CALLS]").name == "mistral"
    assert parser_for_template("<|python_tag|>{{ m }}").name == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        tool_parser("xml")


REASONING = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4", "\nThe user wants 2+2.\n", "4"),
    ("qwen3", "4", None, "4"),  # thinking off
    (
        "qwen3",
        "<think>\nStill thinking when the tokens ran out",
        "\nStill thinking when the tokens ran out",
        None,
    ),
    (
        "deepseek_r1",
        "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.",
        "Okay, 2+2 is 4.\n",
        "The answer is 4.",
    ),
    ("deepseek_r1", "<think>Hmm.</think>Four.", "Hmm.", "Four."),
    ("deepseek_r1", "Cut off in thought", "Cut off in thought", None),
]


@pytest.mark.parametrize(("name", "output", "reasoning", "content"), REASONING)
@pytest.mark.parametrize("step", [1, 4])
def test_reasoning_splits_whole_and_streamed(
    name: str, output: str, reasoning: str | None, content: str | None, step: int
) -> None:
    parser = reasoning_parser(name)
    assert parser.split(output) == (reasoning, content)
    stream = StreamedReasoning(parser)
    pieces = [stream.feed(output[:end]) for end in range(step, len(output), step)]
    pieces.append(stream.feed(output, final=True))
    assert ("".join(r for r, _ in pieces) or None) == reasoning
    assert ("".join(c for _, c in pieces) or None) == content
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("o1")
