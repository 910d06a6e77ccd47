"""Tool calls in a model's output, in the formats models are trained to write them, read into
OpenAI's `tool_calls` (a name, and the arguments as JSON text):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes, Qwen2.5, Qwen3 and many fine-tunes);
- `llama3_json`: `{"name": ..., "parameters": {...}}` as the whole reply, several joined by `;`,
  optionally after `<|python_tag|>` (Llama 3.1, 3.2, 3.3);
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` per call.

Text around the calls is the reply's content. A call that does not parse (bad JSON, no name,
arguments that are not an object) is not a call: its text stays in the content, so a client
sees what the model wrote instead of an error. Streaming holds back the text from where a call
may begin and settles it when the output ends (`StreamedToolCalls`), so the streamed deltas
reassemble to what `parse` returns for the whole text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_LEADING_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None: the reply is calls alone
    tool_calls: list[ToolCall]


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from a decoded JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # (some models write the arguments as JSON text)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _content(pieces: list[str]) -> str | None:
    """The text around the calls, as written (None when it is only whitespace)."""
    text = "".join(pieces)
    return text if text.strip() else None


def _json_values(text: str) -> list[Any] | None:
    """`text` as one JSON value or several joined by `;` (None: it is not)."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    text = text.strip()
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)
        position = end
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
    return values or None


class HermesParser:
    name = "hermes"
    start = "<tool_call>"
    # How a call is written (the grammar of a required call): begin (the name in it), the
    # arguments object, end; between calls; around them all.
    call_begin = '<tool_call>\n{{"name": "{name}", "arguments": '
    call_end = "}\n</tool_call>"
    separator = "\n"
    around = ("", "")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        content: list[str] = []
        position = 0
        for match in self._block.finditer(text):
            try:
                call = _call(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            content.append(text[position : match.start()] if call else text[position : match.end()])
            position = match.end()
            if call is not None:
                calls.append(call)
        content.append(text[position:])
        return ParsedReply(_content(content) if calls else text, calls)


class Llama3JsonParser:
    name = "llama3_json"
    start = "<|python_tag|>"  # (or the reply opening with "{")
    _tag = start
    call_begin = '{{"name": "{name}", "parameters": '
    call_end = "}"
    separator = "; "
    around = ("", "")

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        prefix = ""
        if self._tag in body:
            prefix, body = body.split(self._tag, 1)
        elif not body.startswith("{"):
            return ParsedReply(text, [])
        values = _json_values(body)
        calls = [_call(v, "parameters") for v in values or []]
        if not values or any(c is None for c in calls):
            return ParsedReply(text, [])
        return ParsedReply(_content([prefix]), [c for c in calls if c is not None])


class MistralParser:
    name = "mistral"
    start = "[TOOL_CALLS]"
    _args = "[ARGS]"
    call_begin = '{{"name": "{name}", "arguments": '
    call_end = "}"
    separator = ", "
    around = ("[TOOL_CALLS][", "]")

    def parse(self, text: str) -> ParsedReply:
        if self.start not in text:
            return ParsedReply(text, [])
        prefix, _, rest = text.partition(self.start)
        calls = self._calls(rest.strip()) if rest.strip() else None
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(_content([prefix]), calls)

    def _calls(self, rest: str) -> list[ToolCall] | None:
        if rest.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            values = _json_values(rest)
            if not values or len(values) != 1 or not isinstance(values[0], list):
                return None
            found = [_call(v, "arguments") for v in values[0]]
        else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            found = []
            for piece in rest.split(self.start):
                name, sep, arguments = piece.partition(self._args)
                if not sep:
                    return None
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
                found.append(_call({"name": name.strip(), "arguments": parsed}, "arguments"))
        if not found or any(c is None for c in found):
            return None
        return [c for c in found if c is not None]


ToolParser = HermesParser | Llama3JsonParser | MistralParser
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


# Whitespace inside a call's arguments, at most (as for JSON output: grammars.py).
MAX_ARGUMENT_WHITESPACE = 32


def call_grammar(
    parser: ToolParser, functions: dict[str, dict[str, Any] | None], must_call: str, parallel: bool
) -> dict[str, Any]:
    """An xgrammar structural tag the output must follow when it must call a tool, in the
    parser's format: `must_call` "required" (one call or more, of any of `functions`, name ->
    its parameters schema; just one unless `parallel`) or a function's name (that one, once).
    The arguments follow the function's schema (any object without one)."""

    def tag(name: str) -> dict[str, Any]:
        schema = functions[name] or {"type": "object"}
        return {
            "type": "tag",
            "begin": parser.call_begin.format(name=name),
            "content": {
                "type": "json_schema",
                "json_schema": schema,
                "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE,
            },
            "end": parser.call_end,
        }

    if must_call == "required":
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": [tag(name) for name in functions],
            "separator": parser.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    else:
        calls = tag(must_call)
    before, after = parser.around
    if before or after:
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": before},
                calls,
                {"type": "const_string", "value": after},
            ],
        }
    return {"type": "structural_tag", "format": calls}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError listing the known ones."""
    make = TOOL_PARSERS.get(name)
    if make is None:
        raise ValueError(f"unknown tool-call parser {name!r}: kvfleet has {sorted(TOOL_PARSERS)}")
    return make()


def parser_for_template(chat_template: str | None) -> ToolParser | None:
    """The format a chat template teaches its model, read from the template's own markers
    (None: the template shows no tool-call format; `--tool-call-parser` names one)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesParser()
    if "[TOOL_CALLS]" in chat_template:
        return MistralParser()
    if "<|python_tag|>" in chat_template or '"parameters": ' in chat_template:
        return Llama3JsonParser()
    return None


class StreamedToolCalls:
    """A streamed reply: content deltas up to where a call may begin; the rest, calls or
    content, once the output ends (`finish`), from the same `parse` as a whole reply."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._sent = 0  # characters of content sent
        self._held = False  # a call may have begun: nothing more is sent until the end

    def feed(self, text: str) -> str:
        """The content delta that can be sent now, `text` being the whole reply so far."""
        if self._held:
            return ""
        start = self._call_start(text)
        if start is not None:
            self._held = True
        upto = len(text) - partial_suffix(text, (self.parser.start,)) if start is None else start
        if not self._sent and not text[:upto].strip():  # (whitespace alone may be no content)
            return ""
        delta, self._sent = text[self._sent : upto], max(self._sent, upto)
        return delta

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """The last content delta and the calls, the whole reply being `text`: what was sent
        and this delta make `parse(text).content`."""
        reply = self.parser.parse(text)
        content = reply.content or ""
        sent = text[: self._sent]
        if not content.startswith(sent):  # (cannot happen: content keeps the text before calls)
            raise AssertionError("streamed content diverged from the parsed reply")
        return content[len(sent) :], reply.tool_calls

    def _call_start(self, text: str) -> int | None:
        if isinstance(self.parser, Llama3JsonParser):
            lead = _LEADING_SPACE.match(text).end()  # type: ignore[union-attr]
            if text.startswith("{", lead):
                return lead
            tag = text.find("<|python_tag|>")
            return tag if tag >= 0 else None
        found = text.find(self.parser.start)
        return found if found >= 0 else None


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `markers` (held back while
    streaming, until the next text says whether the marker comes)."""
    longest = max(len(m) for m in markers) - 1
    for size in range(min(longest, len(text)), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0
