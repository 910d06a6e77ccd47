"""Grammars compiled by xgrammar against SmolLM2's tokenizer: what each kind accepts and
refuses, one compile per text, and errors that say what is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.protocol.structured import GrammarFields, GrammarSpec
from kvfleet.engine.structured.grammars import GrammarCompiler, GrammarError
from kvfleet.engine.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model_source("smollm2"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, vocab_size=49152)


def accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, text: str) -> bool:
    matcher: Any = xgr.GrammarMatcher(compiler.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(i) for i in ids) and matcher.is_completed()


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GrammarSpec("json", json.dumps(SCHEMA)), '{"name": "Ann", "age": 3}', '{"name": 3}'),
        (GrammarSpec("json_object"), '{"a": [1, 2]}', "[1, 2]"),
        (GrammarSpec("regex", r"[A-Z][a-z]+ \d{2}"), "Paris 75", "paris 75"),
        (GrammarSpec.choice(["yes", "no"]), "yes", "maybe"),
        (GrammarSpec("grammar", 'root ::= "a" root | "b"'), "aab", "aba"),
    ],
)
def test_each_kind_accepts_what_matches_and_nothing_else(
    compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, good: str, bad: str
) -> None:
    assert accepts(compiler, tokenizer, spec, good)
    assert not accepts(compiler, tokenizer, spec, bad)


def test_a_text_compiles_once(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("regex", r"\d+")
    assert compiler.submit(spec) is compiler.submit(GrammarSpec("regex", r"\d+"))
    assert compiler.compile(spec) is compiler.compile(spec)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json", '{"type": "objectz"}'), 'Unsupported type "objectz"'),
        (GrammarSpec("json", "{not json"), "not valid JSON"),
        (GrammarSpec("json", "[1]"), "must be an object"),
        (GrammarSpec("regex", "([a-z"), "Unclosed"),
        (GrammarSpec("grammar", "root ::= "), "grammar cannot be compiled"),
    ],
)
def test_bad_grammars_say_why(compiler: GrammarCompiler, spec: GrammarSpec, reason: str) -> None:
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(spec)
    with pytest.raises(ValueError, match="choice needs"):
        GrammarSpec.choice([])


SCHEMA_ = {"schema": SCHEMA}


@pytest.mark.parametrize(
    ("fields", "spec"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            },
            GrammarSpec("json", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, GrammarSpec.choice(["x", "y"])),
        ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json", json.dumps(SCHEMA))),
        ({"guided_grammar": 'root ::= "a"'}, GrammarSpec("grammar", 'root ::= "a"')),
    ],
)
def test_the_request_names_one_constraint(fields: dict[str, Any], spec: GrammarSpec | None) -> None:
    assert GrammarFields.model_validate(fields).grammar_spec() == spec


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one output constraint at a time"),
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema object"),
        ({"guided_json": "{bad"}, "guided_json: the JSON schema is not valid JSON"),
        ({"guided_choice": []}, "guided_choice: choice needs"),
    ],
)
def test_bad_constraints_are_refused(fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        GrammarFields.model_validate(fields).grammar_spec()
