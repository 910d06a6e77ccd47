"""Constrained decoding on the GPU (SmolLM2, CUDA graphs, asynchronous scheduling): a batch of
64 requests under JSON schemas, regexes and choices beside free ones keeps every constraint;
an allowed greedy path is left as it is; the masks reach the GPU rows they belong to."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.protocol.structured import GrammarSpec  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_a_mixed_batch_of_64_keeps_every_constraint(smollm2: Path) -> None:
    llm = LLM("smollm2", device="cuda", dtype="bfloat16", max_model_len=1024, num_blocks=2048)
    kinds = [
        GrammarSpec.json_schema(SCHEMA),
        GrammarSpec("regex", "[A-Z]{2}-[0-9]{3}"),
        GrammarSpec.choice(["alpha", "beta", "gamma"]),
        None,
    ]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=400, grammar=kinds[i % 4])
        for i in range(64)
    ]
    prompts = [[{"role": "user", "content": f"Item {i}: describe it as asked."}] for i in range(64)]
    outputs = llm.chat(prompts, params)
    for i, output in enumerate(outputs):
        text, reason = output.outputs[0].text, output.outputs[0].finish_reason
        if i % 4 == 0:
            assert reason == "stop", (i, text, reason)
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 4 == 1:
            assert re.fullmatch("[A-Z]{2}-[0-9]{3}", text), text
        elif i % 4 == 2:
            assert text in ("alpha", "beta", "gamma"), text


def test_an_allowed_greedy_path_is_left_as_it_is_on_cuda(smollm2: Path) -> None:
    llm = LLM("smollm2", device="cuda", dtype="float32", max_model_len=1024, num_blocks=512)
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    alone = llm.chat([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    spec = GrammarSpec.choice([alone, "No idea."])
    free = SamplingParams(temperature=0, max_tokens=16)
    both = llm.chat(
        [prompt] * 2, [SamplingParams(temperature=0, max_tokens=40, grammar=spec), free]
    )
    assert both[0].outputs[0].text == alone
    assert both[0].outputs[0].finish_reason == "stop"
    assert both[1].outputs[0].text == alone
