"""Fault isolation on CUDA (Triton attention and sampler, decode graphs): a request whose step
raises is found and fails alone; its batch mates finish with the tokens of a clean run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvfleet.engine.llm_engine import LLMEngine  # noqa: E402
from kvfleet.engine.output.request_output import RequestOutput  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


def _engine(folder: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cuda",
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=256,
            cache=CacheConfig(block_size=16, num_blocks=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        )
    )


def _run(engine: LLMEngine) -> tuple[dict[str, RequestOutput], list[str]]:
    finished: dict[str, RequestOutput] = {}
    blamed: list[str] = []
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            return finished, blamed
        try:
            outputs = engine.step()
        except Exception:
            blamed += engine.recover_from_failed_step()
            continue
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError("the engine did not finish its requests")


def test_a_poisoned_request_fails_alone_on_cuda(
    hf_model_dir: Callable[[str], tuple[Any, Path]],
) -> None:
    _, folder = hf_model_dir("llama2-tied")
    prompts = {f"r{i}": [3 + (7 * i + 5 * j) % 380 for j in range(20 + 9 * i)] for i in range(4)}
    clean = _engine(folder)
    for rid, prompt in prompts.items():
        clean.add_request(rid, prompt, PARAMS)
    expected, _ = _run(clean)
    del clean

    engine = _engine(folder)
    assert engine.runner.decode_graphs is not None  # decode steps replay graphs
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, PARAMS)
    for _ in range(4):
        engine.step()
    poison = SamplingParams(temperature=0.8, top_k=5, max_tokens=12, seed=1, ignore_eos=True)
    poison.top_k = 10**30  # changed after validation: its sampling tensors cannot be built
    engine.add_request("poison", list(range(3, 40)), poison)
    finished, blamed = _run(engine)
    assert blamed == ["poison"]
    assert {r: o.outputs[0].token_ids for r, o in finished.items()} == {
        r: o.outputs[0].token_ids for r, o in expected.items()
    }
    engine.add_request("after", prompts["r0"], PARAMS)
    after, blamed = _run(engine)
    assert blamed == []
    assert after["after"].outputs[0].token_ids == expected["r0"].outputs[0].token_ids
