"""Constrained decoding through the engine (SmolLM2, float32, CPU): every kind of output
constraint holds, greedy or sampled, beside free requests and speculative drafts; an allowed
greedy path is left as it is; a request waits in the scheduler for its grammar while others
step; preemption and a failed step keep the matchers in step with the tokens."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from typing import Any

import pytest

from kvfleet.engine.llm import LLM
from kvfleet.engine.output.request_output import RequestOutput
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.sampling_params import SamplingParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", max_num_batched_tokens=256)


def text(output: RequestOutput, index: int = 0) -> str:
    return output.outputs[index].text


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_kind_of_constraint_holds(llm: LLM, temperature: float) -> None:
    def params(spec: GrammarSpec, n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=7, max_tokens=80, n=n, grammar=spec)

    specs = [
        params(GrammarSpec.json_schema(PERSON), n=2),
        params(GrammarSpec("json_object")),
        params(GrammarSpec("regex", r"(red|green|blue)-[0-9]{2,4}")),
        params(GrammarSpec.choice(["yes", "no", "maybe not"])),
        params(GrammarSpec("grammar", 'root ::= "(" [a-c]+ ")"')),
        SamplingParams(temperature=temperature, seed=7, max_tokens=8),  # a free neighbour
    ]
    prompts = [PROMPT] * len(specs)
    prompts[1] = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} only.'}]
    outputs = llm.chat(prompts, specs)
    for i in range(2):
        assert outputs[0].outputs[i].finish_reason == "stop"
        jsonschema.validate(json.loads(text(outputs[0], i)), PERSON)
    assert isinstance(json.loads(text(outputs[1])), dict), text(outputs[1])
    assert re.fullmatch(r"(red|green|blue)-[0-9]{2,4}", text(outputs[2]))
    assert text(outputs[3]) in ("yes", "no", "maybe not")
    assert re.fullmatch(r"\([a-c]+\)", text(outputs[4]))
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[1:5])


def test_an_allowed_greedy_path_is_left_as_it_is(llm: LLM) -> None:
    # A choice between the free greedy text and another: under the mask the model writes the
    # same tokens, then ends where the grammar is complete. Its free neighbour, drafted for
    # by n-grams in another engine, is unchanged by the constrained row beside it.
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = text(llm.chat([PROMPT], free)[0])
    spec = GrammarSpec.choice([alone, "Something else entirely."])
    both = llm.chat(
        [PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=40, grammar=spec), free]
    )
    assert text(both[0]) == alone
    assert both[0].outputs[0].finish_reason == "stop"
    assert text(both[1]) == alone
    drafting = LLM(
        "smollm2",
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    )
    repeat = [{"role": "user", "content": "Repeat after me: one two three, one two three, one"}]
    long_free = SamplingParams(temperature=0, max_tokens=40)
    expected = text(drafting.chat([repeat], long_free)[0])
    constrained = SamplingParams(temperature=0, max_tokens=40, grammar=spec)
    mixed = drafting.chat([PROMPT, repeat], [constrained, long_free])
    assert text(mixed[0]) == alone
    assert text(mixed[1]) == expected
    assert drafting.engine.scheduler.spec_decode_stats.num_accepted_tokens > 0


def test_a_request_waits_for_its_grammar_while_others_step(llm: LLM) -> None:
    engine = llm.engine
    assert engine.grammars is not None
    compiler = engine.grammars.compiler
    real = compiler.submit
    spec = GrammarSpec("regex", "slow+")
    held: Future[Any] = Future()
    release = threading.Event()

    def finish() -> None:
        release.wait(30)
        held.set_result(real(spec).result())

    finishing = threading.Thread(target=finish, daemon=True)

    def slow_submit(s: GrammarSpec) -> Future[Any]:
        if s != spec:
            return real(s)
        if not finishing.is_alive() and not held.done():
            finishing.start()
        return held

    compiler.submit = slow_submit  # type: ignore[method-assign]
    try:
        engine.add_request(
            "slow", "Say it:", SamplingParams(temperature=0, max_tokens=6, grammar=spec)
        )
        engine.add_request("free", "Count: 1, 2,", SamplingParams(temperature=0, max_tokens=4))
        finished: dict[str, RequestOutput] = {}
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        waiting = engine.scheduler.requests["slow"]  # type: ignore[index]
        assert waiting.waits_for_grammar
        assert waiting.num_computed_tokens == 0
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert re.fullmatch("slow+", text(finished["slow"]))
    finally:
        compiler.submit = real  # type: ignore[method-assign]
        release.set()


def test_bad_constraints_are_refused_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1: the regex cannot be compiled"):
        llm.generate(
            ["a", "b"],
            [SamplingParams(max_tokens=2), SamplingParams(grammar=GrammarSpec("regex", "([a"))],
        )
    with pytest.raises(ValueError, match="the JSON schema is not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, grammar=GrammarSpec("json_object"))
    with pytest.raises(ValueError, match="grammar must be a GrammarSpec"):
        SamplingParams(grammar="[a-z]+")  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("a", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_preemption_and_a_failed_step_keep_matchers_in_step() -> None:
    # A pool too small for every request at once preempts and recomputes constrained ones; a
    # step that fails after the matchers took its tokens (here: in output processing) resets
    # every request to the tokens its client was given, and the matchers roll back with them:
    # seeded draws are keyed by position, so the texts equal those of a run without failure.
    llm = LLM(
        "smollm2", dtype="float32", num_blocks=16, max_num_batched_tokens=64, max_model_len=128
    )
    engine = llm.engine
    params = SamplingParams(
        temperature=0.7, seed=3, max_tokens=90, grammar=GrammarSpec.json_schema(PERSON)
    )
    process = engine.output_processor.process

    def run(fail_at: int | None) -> dict[str, str]:
        for i in range(10):
            engine.add_request(f"r{i}-{fail_at}", f"Person number {i} as JSON:", params)
        calls = 0

        def failing_once(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == fail_at:
                raise RuntimeError("injected")
            return process(*args, **kwargs)

        engine.output_processor.process = failing_once  # type: ignore[method-assign]
        finished: dict[str, str] = {}
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except RuntimeError:
                assert engine.recover_from_failed_step() == []
                continue
            for output in outputs:
                if output.finished:
                    assert output.outputs[0].finish_reason == "stop", text(output)
                    jsonschema.validate(json.loads(text(output)), PERSON)
                    finished[output.request_id.split("-")[0]] = text(output)
        return finished

    clean = run(None)
    preemptions = engine.stats().num_preemptions
    assert preemptions > 0
    assert run(12) == clean
    assert engine.stats().num_preemptions > preemptions
