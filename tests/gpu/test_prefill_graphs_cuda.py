"""Steps with prompt tokens replayed from CUDA graphs in pieces around attention
(engine/worker/prefill_graphs.py) on the GPU: the same tokens and logprobs as the eager path,
over prompts of every bucket and above, prompt chunks, prefix-cache hits and decodes beside
chunks; with an FP8 KV cache whose scales are measured on the first prompt (eager, then the
pieces). The logic of the pieces on the CPU: tests/unit/engine/test_prefill_graphs.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402


def _prompts() -> list[list[int]]:
    lengths = [3, 15, 16, 17, 40, 100, 130, 300]  # (bucket edges, and above 128)
    shared = [5 + (11 * j) % 300 for j in range(48)]  # (a 3-block prefix, hit by the last two)
    return [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate(lengths)] + [
        [*shared, 9, 10],
        [*shared, 11, 12, 13],
        [*shared, 14],
    ]


def _generate(folder: Path, pieces: int, **settings: Any) -> tuple[list[Any], LLM]:
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        num_blocks=256,
        max_model_len=512,
        max_num_batched_tokens=128,  # (the 130- and 300-token prompts in chunks, beside decodes)
        prefill_graph_tokens=pieces,
        **settings,
    )
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0, max_tokens=5 + i % 4, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts[:1], params[:1]) + llm.generate(prompts[1:], params[1:])
    return [
        (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs
    ], llm


@pytest.mark.parametrize("kv_cache", ["auto", "fp8-measured"])
def test_prompt_steps_in_pieces_equal_eager(
    hf_model_dir: Callable[[str], tuple[Any, Path]], kv_cache: str
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    settings: dict[str, Any] = {}
    if kv_cache == "fp8-measured":
        settings = {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    eager, _ = _generate(folder, 0, **settings)
    replayed, llm = _generate(folder, 128, **settings)
    pieces = llm.engine.runner.prefill_graphs
    assert pieces is not None
    assert sorted(pieces.pieces) == [(16, False), (32, False), (64, False), (128, False)]
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert all(len(p.graphs) == layers + 1 for p in pieces.pieces.values())
    for (eager_ids, eager_lp), (ids, lp) in zip(eager, replayed, strict=True):
        assert ids == eager_ids
        assert max(abs(a - b) for a, b in zip(eager_lp, lp, strict=True)) < 1e-4


def test_no_prefill_graphs_when_eager_or_switched_off(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
) -> None:
    _, folder = hf_model_dir("llama3-rope-untied")
    for settings in ({"enforce_eager": True}, {"prefill_graph_tokens": 0}):
        llm = LLM(str(folder), device="cuda", dtype="float32", skip_tokenizer_init=True,
                  num_blocks=64, max_model_len=256, **settings)  # fmt: skip
        assert llm.engine.runner.prefill_graphs is None
