"""A chat reply read for what the client asked: reasoning apart (`reasoning_content`), tool
calls apart (`tool_calls`, `finish_reason: "tool_calls"`), whole or as stream deltas that
reassemble to the whole (engine/structured/tool_calls.py, reasoning.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvfleet.engine.protocol.openai import ChatCompletionRequest
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.structured.reasoning import (
    ReasoningParser,
    StreamedReasoning,
    reasoning_parser,
)
from kvfleet.engine.structured.tool_calls import (
    TOOL_PARSERS,
    StreamedToolCalls,
    ToolCall,
    ToolParser,
    call_grammar,
    parser_for_template,
    tool_parser,
)
from kvfleet.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class OutputParsers:
    """How this server reads replies: the model's tool-call format (None: unknown, so tools
    cannot be offered) and its reasoning format (None: no reasoning split)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    @classmethod
    def configure(
        cls, tokenizer: Tokenizer | None, tool_call_parser: str, reasoning: str | None
    ) -> OutputParsers:
        """From the server's flags; "auto" reads the format off the chat template."""
        template = getattr(tokenizer.hf, "chat_template", None) if tokenizer else None
        tools = (
            parser_for_template(template if isinstance(template, str) else None)
            if tool_call_parser == "auto"
            else tool_parser(tool_call_parser)
        )
        return cls(tools, reasoning_parser(reasoning) if reasoning else None)

    def for_request(self, with_tools: bool) -> OutputParsers | None:
        """The parsers a request's reply goes through (None: its text as it is)."""
        parsers = self if with_tools else replace(self, tools=None)
        return parsers if parsers.tools or parsers.reasoning else None


def chat_setup(
    parsers: OutputParsers, req: ChatCompletionRequest
) -> tuple[OutputParsers | None, GrammarSpec | None]:
    """How a chat request's reply is read, and the grammar of the call it requires (None:
    none required); ValueError for tools this server cannot serve or a choice they cannot
    meet."""
    mode = req.tool_choice_mode()
    grammar = None
    if mode is not None:
        if parsers.tools is None:
            raise ValueError(
                "tools: this model's chat template shows no tool-call format; start the "
                f"server with --tool-call-parser (one of {sorted(TOOL_PARSERS)})"
            )
        if mode != "auto":
            if req.grammar_spec() is not None:
                raise ValueError(
                    "a tool_choice that requires a call cannot be combined with an output "
                    "constraint (response_format, structured_outputs, guided_*)"
                )
            functions = {t.function.name: t.function.parameters for t in req.tools or []}
            tag = call_grammar(parsers.tools, functions, mode, req.parallel_tool_calls)
            grammar = GrammarSpec("structural_tag", json.dumps(tag))
    return parsers.for_request(mode is not None), grammar


def call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return body if index is None else {"index": index, **body}


def _finish(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def chat_message(
    text: str, finish_reason: str | None, parsers: OutputParsers
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole reply, and its finish reason."""
    reasoning, content = parsers.reasoning.split(text) if parsers.reasoning else (None, text)
    calls: list[ToolCall] = []
    if parsers.tools is not None:
        reply = parsers.tools.parse(content or "")
        if reply.tool_calls:
            content, calls = reply.content, reply.tool_calls
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parsers.reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call_body(c) for c in calls]
    return message, _finish(finish_reason, calls)


class ChatStream:
    """One streamed choice: each new text gives a delta (reasoning, content, and at the end
    the tool calls) that together make `chat_message` of the whole."""

    def __init__(self, parsers: OutputParsers) -> None:
        self.parsers = parsers
        self._reasoning = StreamedReasoning(parsers.reasoning) if parsers.reasoning else None
        self._tools = StreamedToolCalls(parsers.tools) if parsers.tools else None
        self._content = ""  # the content so far (after the reasoning)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for the whole text so far; the finish reason once `finish_reason` is."""
        final = finish_reason is not None
        reasoning = ""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
        else:
            content = text[len(self._content) :]
        self._content += content
        calls: list[ToolCall] = []
        if self._tools is not None:
            content = self._tools.feed(self._content)
            if final:
                last, calls = self._tools.finish(self._content)
                content += last
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call_body(c, i) for i, c in enumerate(calls)]
        return delta, _finish(finish_reason, calls)
