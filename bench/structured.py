"""`kvfleet bench structured`: decode step time with every request under a JSON schema against
the same batch unconstrained, in one process, alternating; and grammar compile times.

The constrained requests' schema has 48 required properties (strings, integers, enums; with
`--bounded`, length- and range-bounded ones), so no output can be complete before
`--output-len` tokens and every step runs under a structural mask (keys forced, values typed),
as an extraction workload does. Each step's bitmask (a row per request) is filled on a worker
thread while the forward runs and the engine thread processes the step before (`fill_ms`: that
host time per step; `mask_wait_ms`: what the engine thread still waits for it), then applied on
the GPU before sampling.

`--tokenizer DIR --vocab-size N`: a dummy model has no tokenizer, and the grammar's cost follows
the vocabulary, so the tokenizer at DIR is grown to N entries (each new one two existing
tokens joined, as BPE merges read) to stand in for the model's own (Llama 3: 128,256).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvfleet.bench.ceilings import sync
from kvfleet.bench.report import emit
from kvfleet.engine.llm import LLM
from kvfleet.engine.protocol.structured import GrammarSpec
from kvfleet.engine.sampling_params import SamplingParams


def extraction_schema(num_fields: int = 48, bounded: bool = False) -> dict[str, Any]:
    """`num_fields` required properties: strings, integers, enums (`bounded`: strings of at
    most 24 characters and integers in [0, 100000], which xgrammar expands into counted
    repetitions: more grammar states, dearer masks)."""
    kinds: list[dict[str, Any]] = [{"type": "string"}, {"type": "integer"}]
    if bounded:
        kinds = [
            {"type": "string", "maxLength": 24},
            {"type": "integer", "minimum": 0, "maximum": 100000},
        ]
    kinds.append({"enum": ["low", "medium", "high"]})
    properties = {f"field_{i:02d}": kinds[i % 3] for i in range(num_fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def large_schema() -> dict[str, Any]:
    """150 nested objects with patterned strings: seconds to compile."""
    fields = {
        f"field_{i}": {
            "type": "object",
            "properties": {
                f"sub_{j}": {"type": "string", "pattern": f"^[a-z]{{2,8}}[0-9]{{0,{j}}}$"}
                for j in range(8)
            },
            "required": [f"sub_{j}" for j in range(3)],
        }
        for i in range(150)
    }
    return {"type": "object", "properties": fields, "required": ["field_0"]}


def grown_tokenizer(folder: str, vocab_size: int | None, scratch: Path) -> str:
    if vocab_size is None:
        return folder
    source = Path(folder)
    data = json.loads((source / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"] for t in data.get("added_tokens", [])}
    pieces = [p for p in vocab if p not in special]
    rng = random.Random(0)
    next_id = max(vocab.values()) + 1 + len(special)
    while next_id < vocab_size:
        piece = rng.choice(pieces) + rng.choice(pieces)
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    for name in source.iterdir():
        if name.name != "tokenizer.json":
            (scratch / name.name).write_bytes(name.read_bytes())
    (scratch / "tokenizer.json").write_text(json.dumps(data))
    return str(scratch)


def _record_durations(owner: Any, method: str) -> list[float]:
    """Wrap `owner.method` to record how long each call takes (host seconds)."""
    durations: list[float] = []
    wrapped = getattr(owner, method)

    def timed_call(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return wrapped(*args)
        finally:
            durations.append(time.perf_counter() - began)

    setattr(owner, method, timed_call)
    return durations


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-") as scratch:
        return _run(args, grown_tokenizer(args.tokenizer, args.vocab_size, Path(scratch)))


def _run(args: argparse.Namespace, tokenizer: str) -> int:
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        tokenizer=tokenizer,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=max(2048, args.batch_size * args.input_len),
    )
    engine = llm.engine
    assert engine.tokenizer is not None
    vocab = len(engine.tokenizer.hf)
    compile_s = {}
    began = time.perf_counter()  # (the first grammar reads the tokenizer's vocabulary)
    engine.compile_grammar(GrammarSpec("regex", "[0-9]+")).result()
    compile_s["first"] = time.perf_counter() - began
    for name, schema in (("small", extraction_schema(4)), ("large", large_schema())):
        spec = GrammarSpec.json_schema(schema)
        began = time.perf_counter()
        engine.compile_grammar(spec).result()
        compile_s[name] = time.perf_counter() - began
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        100, 30000, (args.batch_size, args.input_len), generator=generator
    ).tolist()
    spec = GrammarSpec.json_schema(extraction_schema(bounded=args.bounded))
    engine.compile_grammar(spec).result()

    def params(max_tokens: int, constrained: bool) -> SamplingParams:
        if constrained:
            return SamplingParams(temperature=0, max_tokens=max_tokens, grammar=spec)
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def timed(max_tokens: int, constrained: bool) -> float:
        sync(engine.device)
        began = time.perf_counter()
        outputs = llm.generate(prompts, params(max_tokens, constrained))
        sync(engine.device)
        elapsed = time.perf_counter() - began
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    for constrained in (False, True):  # warm up
        timed(4, constrained)
    assert engine.grammars is not None
    fills = _record_durations(engine.grammars, "_fill")
    waits = _record_durations(engine.grammars, "bitmask")
    advances = _record_durations(engine.grammars, "advance")
    decode: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for constrained in (False, True):
            first = timed(1, constrained)
            total = timed(args.output_len, constrained)
            decode[constrained].append((total - first) / (args.output_len - 1))
    free_s = statistics.median(decode[False])
    masked_s = statistics.median(decode[True])
    result: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "tokenizer_vocab": vocab,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "free_ms_per_step": round(free_s * 1e3, 3),
        "json_schema_ms_per_step": round(masked_s * 1e3, 3),
        "bounded_schema": args.bounded,
        "ratio": round(masked_s / free_s, 3),
        "fill_ms_per_step_median": round(statistics.median(fills) * 1e3, 3),
        "mask_wait_ms_per_step_median": round(statistics.median(waits) * 1e3, 3),
        "accept_ms_per_step_median": round(statistics.median(advances) * 1e3, 3),
        "first_grammar_s": round(compile_s["first"], 3),
        "compile_small_s": round(compile_s["small"], 4),
        "compile_large_s": round(compile_s["large"], 3),
    }
    emit(result, args.json)
    engine.close()
    return 0
