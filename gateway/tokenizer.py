"""GatewayTokenizer: prompts to token ids exactly as the engine makes them, without transformers.

Built from an engine's `/tokenizer` (its fast tokenizer's tokenizer.json and chat template), it
encodes with the `tokenizers` library and renders chat templates with jinja2 the way
transformers does (sandboxed, trimmed blocks, `raise_exception`, `tojson`), so the gateway's
block hashes equal the engine's and prefix routing is exact. The gateway image stays light.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvfleet.engine.protocol.openai import Message, normalize_message


class GatewayTokenizer:
    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        block_size: int,
    ) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.special_tokens = dict(special_tokens)
        self.block_size = block_size
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> GatewayTokenizer:
        """From the JSON body of an engine's GET /tokenizer."""
        return cls(
            str(info["tokenizer"]),
            info.get("chat_template"),
            info.get("special_tokens") or {},
            int(info["block_size"]),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def chat_ids(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt tokens, as the engine's chat endpoint builds them (with
        the tools offered and the request's `chat_template_kwargs`)."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
        text = self._template.render(
            **{
                **self.special_tokens,
                **dict(template_kwargs or {}),
                "messages": [normalize_message(m) for m in messages],
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
            }
        )
        return self.encode(text, add_special_tokens=False)


def _compile(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
