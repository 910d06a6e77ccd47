"""Asynchronous scheduling and tensor parallelism on CUDA (Triton kernels, CUDA graphs, NCCL).

Asynchronous and one-step-at-a-time scheduling run the same batches when requests end only by
max_tokens (a request is never scheduled past it), so their bf16 outputs must be identical.
Tensor parallelism over 2 GPUs is checked the same way against itself, and against one GPU
in float32 within float32 rounding, and its vocabulary race (each GPU samples over its shard)
against one GPU's, token for token. (Only a process's first tensor-parallel engine all-reduces
through peer memory, engine/parallel/peer.py; the later ones here use NCCL, so the sync/async
comparison also sets the two all-reduces against each other.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.output.request_output import RequestOutput  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # (the workers start with PyTorch's default: off)


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randint(100, vocab - 100, (20 + 37 * i,), generator=generator).tolist()
        for i in range(12)
    ]


# Llama-3's layout at a quarter of 8B's width and 6 layers: quick to build, real GQA (4 kv heads).
CONFIG = {
    **json.loads((Path(__file__).parents[2] / "engine/configs/llama-3-8b.json").read_text()),
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _run(config: Path, race: bool = False, **engine_args: object) -> list[RequestOutput]:
    """`race`: requests the vocabulary race serves (greedy, and seeded at temperature 1 with
    no top-p or logprobs); else ones the torch sampler serves over the gathered logits."""
    llm = LLM(str(config), load_format="dummy", max_model_len=1024, **engine_args)
    try:
        prompts = _prompts(llm.engine.model_config.vocab_size)
        if race:
            params = [
                SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True)
                if i % 2
                else SamplingParams(temperature=1.0, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
                for i in range(len(prompts))
            ]
        else:
            params = [
                SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=2)
                for i in range(len(prompts))
            ]
            params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30)
        return llm.generate(prompts, params)
    finally:
        llm.engine.close()


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_async_scheduling_equals_one_step_at_a_time_with_graphs(config: Path) -> None:
    common = {"dtype": "bfloat16", "num_blocks": 1024, "max_num_batched_tokens": 256}
    sync = _run(config, async_scheduling=False, **common)
    overlapped = _run(config, **common)
    assert _tokens(overlapped) == _tokens(sync)
    for a, b in zip(overlapped, sync, strict=True):
        assert [lp.logprob for lp in a.outputs[0].logprobs or []] == [
            lp.logprob for lp in b.outputs[0].logprobs or []
        ]
    raced_sync = _run(config, race=True, async_scheduling=False, **common)
    assert _tokens(_run(config, race=True, **common)) == _tokens(raced_sync)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_async_equals_sync_and_float32_equals_one_gpu(config: Path) -> None:
    common = {"num_blocks": 1024, "max_num_batched_tokens": 256, "tensor_parallel_size": 2}
    sync = _run(config, dtype="bfloat16", async_scheduling=False, **common)
    overlapped = _run(config, dtype="bfloat16", **common)
    assert _tokens(overlapped) == _tokens(sync)

    one = _run(config, dtype="float32", num_blocks=1024, max_num_batched_tokens=256)
    two = _run(config, dtype="float32", **common)
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=False):
            if x.token_id != y.token_id:
                break  # a near-tie took another path: compare no further
            worst = max(worst, abs(x.logprob - y.logprob))
    same_first = sum(
        a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for a, b in zip(one, two, strict=True)
    )
    assert same_first == len(one)
    print(f"TP=2 vs TP=1, float32: max |logprob difference| {worst:.2e}")
    assert worst < 1e-3, f"max |logprob difference| TP=2 vs TP=1 in float32: {worst:.2e}"

    # The vocabulary race over 2 shards: the same greedy and seeded tokens as on one GPU.
    one_raced = _run(config, race=True, dtype="float32", num_blocks=1024)
    two_raced = _run(config, race=True, dtype="float32", **common)
    assert _tokens(two_raced) == _tokens(one_raced)
