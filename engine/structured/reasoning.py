"""Reasoning in a model's output, `<think>...</think>`, returned apart from the answer as
OpenAI-compatible `reasoning_content` (the field vLLM and DeepSeek's API use):

- `qwen3`: the model opens `<think>` itself (Qwen3, QwQ); an output without it is all answer
  (thinking turned off with `chat_template_kwargs: {"enable_thinking": false}`);
- `deepseek_r1`: the chat template opens `<think>` in the prompt (DeepSeek-R1 and its
  distills), so the output is reasoning up to `</think>`, with or without an opening tag.

An output cut before `</think>` is reasoning alone. Streaming (`StreamedReasoning`) sends
reasoning deltas, then content deltas, holding back only what may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engine.structured.tool_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_in_prompt: bool  # the template opens <think>: the output starts inside it

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        head = text.lstrip()
        opened = head.startswith(OPEN)
        if opened:
            text = head[len(OPEN) :]
        elif not self.opened_in_prompt:
            return None, text or None
        reasoning, closed, content = text.partition(CLOSE)
        if not closed:
            return reasoning or None, None
        return reasoning or None, content.lstrip("\n") or None


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", opened_in_prompt=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opened_in_prompt=True),
}


def reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}: kvfleet has {sorted(REASONING_PARSERS)}"
        )
    return parser


class StreamedReasoning:
    """Deltas of reasoning and content as the output grows; together they make `split`."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._reasoning = ""  # sent so far
        self._content = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta), `text` being the whole output so far; `final`:
        it is complete (nothing held back)."""
        if not final:
            text = text[: len(text) - partial_suffix(text, (OPEN, CLOSE))]
        reasoning, content = self.parser.split(text)
        reasoning, content = reasoning or "", content or ""
        deltas = (_after(reasoning, self._reasoning), _after(content, self._content))
        self._reasoning, self._content = reasoning, content
        return deltas


def _after(now: str, sent: str) -> str:
    return now[len(sent) :] if now.startswith(sent) else ""
