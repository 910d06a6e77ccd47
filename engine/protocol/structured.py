"""How a request constrains its output, in the wire's terms: OpenAI's `response_format`,
vLLM's `structured_outputs` and its older `guided_*` fields, read into one `GrammarSpec` (the
engine compiles it, engine/structured/)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvfleet.engine.protocol.base import OpenAIBaseModel

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


MAX_GRAMMAR_TEXT = 1 << 20  # characters of a schema, regex or grammar


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: `text` is the JSON schema (as JSON), the regex,
    the EBNF grammar, the choices (a JSON list of strings), or an xgrammar structural tag
    (JSON: a tool call's format); empty for any JSON object.
    Compiled by the engine (engine/structured/)."""

    kind: GrammarKind
    text: str = ""

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("choice needs a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return cls("json", json.dumps(schema))


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's `structured_outputs`: one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_TEXT)
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_TEXT)

    model_config = ConfigDict(populate_by_name=True)


class GrammarFields(OpenAIBaseModel):
    """The ways a request constrains its output (OpenAI's `response_format`; vLLM's
    `structured_outputs` and its older `guided_*` names); `grammar_spec` reads them."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_TEXT)
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_TEXT)

    def grammar_spec(self) -> GrammarSpec | None:
        """The one constraint the request names (None: free text); ValueError for two, or for
        one that is incomplete."""
        found: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: json_schema needs its json_schema object")
            found.append(("response_format", GrammarSpec.json_schema(rf.json_schema.schema_)))
        so = self.structured_outputs
        named = [
            ("structured_outputs.json", so and so.json_, GrammarSpec.json_schema),
            ("structured_outputs.regex", so and so.regex, lambda v: GrammarSpec("regex", v)),
            ("structured_outputs.choice", so and so.choice, GrammarSpec.choice),
            ("structured_outputs.grammar", so and so.grammar, lambda v: GrammarSpec("grammar", v)),
            ("guided_json", self.guided_json, GrammarSpec.json_schema),
            ("guided_regex", self.guided_regex, lambda v: GrammarSpec("regex", v)),
            ("guided_choice", self.guided_choice, GrammarSpec.choice),
            ("guided_grammar", self.guided_grammar, lambda v: GrammarSpec("grammar", v)),
        ]
        for name, value, make in named:
            if value is not None:
                try:
                    found.append((name, make(value)))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if len(found) > 1:
            raise ValueError(
                f"one output constraint at a time, got {', '.join(n for n, _ in found)}"
            )
        return found[0][1] if found else None
