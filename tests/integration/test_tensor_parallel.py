"""Tensor parallelism on the CPU with gloo: real worker processes, real collectives.

SmolLM2 split over 2 ranks (its 3 KV heads go 2 + 1) generates exactly what 1 rank does, with
logprobs equal within float32 rounding; a random config with fewer KV heads than ranks works;
killing a worker makes the server unhealthy, then exit with code 1 and the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

from .conftest import MODEL, Server, start_server

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Translate to French: good morning",
    "Water boils at",
    "A haiku about the sea:",
]


def generate(
    tensor_parallel_size: int, model: str, prompts: list[str] | list[list[int]], **extra: object
) -> list[Any]:
    llm = LLM(
        model,
        dtype="float32",
        num_blocks=512,
        tensor_parallel_size=tensor_parallel_size,
        **{"max_model_len": 512, **extra},
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=64, logprobs=5, ignore_eos=True)
        return list(llm.generate(prompts, params))
    finally:
        llm.engine.close()


def test_smollm2_two_ranks_generate_what_one_does() -> None:
    one = generate(1, MODEL, PROMPTS)
    two = generate(2, MODEL, PROMPTS)
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        first, second = a.outputs[0], b.outputs[0]
        assert first.token_ids == second.token_ids
        assert len(first.token_ids) == 64
        for step_a, step_b in zip(first.logprobs, second.logprobs, strict=True):
            assert step_a.top_token_ids == step_b.top_token_ids
            pairs = zip(step_a.top_logprobs, step_b.top_logprobs, strict=True)
            worst = max(
                worst, abs(step_a.logprob - step_b.logprob), *(abs(x - y) for x, y in pairs)
            )
    assert worst < 1e-3, worst


def test_fewer_kv_heads_than_ranks(tiny_config: Callable[..., Path]) -> None:
    path = tiny_config()
    prompts = [list(range(1, 2 + 3 * i)) for i in range(8)]
    one = generate(1, str(path), prompts, load_format="dummy", skip_tokenizer_init=True)
    # four ranks: each KV head on 2 ranks with 2 query heads each; two ranks: 1 KV head each
    for size in (4, 2):
        other = generate(size, str(path), prompts, load_format="dummy", skip_tokenizer_init=True)
        for a, b in zip(one, other, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize(
    "family",
    [
        "qwen3-qk-norm-yarn",
        "qwen3-moe-dense-layer",
        "mixtral-moe",
        "phi3-longrope",
        "gemma2-softcap-windows",
        "gemma3-local-global",
    ],
)
def test_new_families_over_two_ranks_equal_one(
    family: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    """Qwen3's RMSNorms over each head of q and k (their weights whole on every rank); the
    experts of Qwen3-MoE and Mixtral, each split along its inner dimension (every rank holds
    all of them), beside Qwen3-MoE's dense layer; Phi-3's fused qkv_proj and gate_up_proj, cut
    into their parts before each rank takes its slice; Gemma's norms on the attention's and the
    MLP's outputs (summed over the ranks first) and soft-capped logits over vocabulary shards:
    greedy tokens equal, logprobs within float32 rounding."""
    _, folder = hf_model_dir(family)
    prompts = [list(range(1, 2 + 3 * i)) for i in range(4)]
    one, two = (generate(size, str(folder), prompts, skip_tokenizer_init=True) for size in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(step_a.logprob - step_b.logprob) < 1e-4


def race_tokens(
    size: int, path: Path, prompts: list[list[int]], params: list[SamplingParams], race: bool
) -> list[list[int]]:
    llm = LLM(
        str(path),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        num_blocks=256,
        max_model_len=256,
        tensor_parallel_size=size,
    )
    # NOTE: the vocabulary race is the CUDA path; rank 0 decides per step and its workers
    # follow, so turning it on here runs it on every rank (Triton's interpreter on the CPU).
    runner = llm.engine.runner
    runner.race_sampling = race
    raced = []
    original = runner._race_batch
    runner._race_batch = lambda step: raced.append(1) or original(step)  # type: ignore[method-assign]
    try:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    assert bool(raced) == race
    return tokens


def test_vocabulary_race_over_two_ranks_equals_one(tiny_config: Callable[..., Path]) -> None:
    """Each rank races its vocabulary shard and the ranks take the best: greedy and seeded
    temperature-1 tokens with TP=2 equal TP=1's; greedy ones equal the torch sampler's."""
    path = tiny_config()
    prompts = [list(range(1, 2 + 3 * i)) for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    one = race_tokens(1, path, prompts, params, race=True)
    assert race_tokens(2, path, prompts, params, race=True) == one
    torch_sampler = race_tokens(1, path, prompts, params, race=False)
    assert one[0::2] == torch_sampler[0::2]
    assert all(len(tokens) == 12 for tokens in one)


@pytest.mark.parametrize(
    ("fmt", "group", "bits"), [("awq", 64, 4), ("gptq", 128, 4), ("gptq", 64, 8)]
)
def test_int4_checkpoints_over_two_ranks_equal_one(
    tmp_path: Path, fmt: str, group: int, bits: int
) -> None:
    """AWQ and GPTQ (4- and 8-bit) tensors split in their own layouts (packed words, groups)
    as each rank loads them: greedy tokens equal, logprobs within float32 rounding."""
    from tests.unit.engine.quantization.checkpoints import random_llama
    from tests.unit.engine.quantization.test_int4_checkpoints import _write_int4

    _write_int4(tmp_path, random_llama(), fmt, group, sym=False, act_order=False, bits=bits)
    prompts = [list(range(1, 2 + 3 * i)) for i in range(4)]
    extra: dict[str, Any] = {"skip_tokenizer_init": True}
    one, two = (generate(size, str(tmp_path), prompts, **extra) for size in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(step_a.logprob - step_b.logprob) < 1e-3


def test_a_gguf_kept_packed_over_two_ranks_equals_one(tmp_path: Path) -> None:
    """quantization="gguf": Q4 and Q8_0 rows cut before repacking, inputs in whole blocks of
    32 (4-bit layers and 8-bit ones, some with Q4 parts)."""
    from gguf import GGMLQuantizationType as Q

    import tests.unit.engine.test_gguf_loader as tiny

    saved = tiny.LAYER_TYPES
    tiny.LAYER_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q8_0, Q.Q4_1, Q.Q8_0]
    try:
        tiny.write_model(tmp_path / "q4.gguf", tied=False)
    finally:
        tiny.LAYER_TYPES = saved
    prompts = [list(range(1, 2 + 3 * i)) for i in range(4)]
    extra: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "quantization": "gguf",
        "max_model_len": 256,
    }
    one, two = (generate(size, str(tmp_path / "q4.gguf"), prompts, **extra) for size in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.fixture
def tp_server(tmp_path: Path) -> Iterator[Server]:
    server = start_server(tmp_path, "--tensor-parallel-size", "2")
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(30)


def _worker_pids(parent: int) -> list[int]:
    """The spawned rank processes of `parent` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "spawn_main" in command:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker")
def test_killing_a_worker_fails_the_engine_loudly(tp_server: Server) -> None:
    reply = httpx.post(
        f"{tp_server.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200
    (worker,) = _worker_pids(tp_server.process.pid)
    os.kill(worker, signal.SIGKILL)
    saw_unhealthy = False
    deadline = time.monotonic() + 60
    while tp_server.process.poll() is None and time.monotonic() < deadline:
        try:
            health = httpx.get(f"{tp_server.url}/health", timeout=2)
            saw_unhealthy |= health.status_code == 503
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert tp_server.process.wait(30) == 1
    assert saw_unhealthy, "/health should answer 503 before the server exits"
    log = tp_server.log.read_text()
    assert "tensor-parallel worker rank 1" in log
    assert "exited with code -9" in log
    assert "kvfleet: error: the engine failed" in log


def test_bad_tensor_parallel_settings_are_refused_before_any_worker_starts() -> None:
    from kvfleet.engine.config import EngineConfig, LoRAConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(model=MODEL, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="LoRA adapters are not available with tensor"):
        EngineConfig(model=MODEL, tensor_parallel_size=2, lora=LoRAConfig(enable_lora=True))
    # SmolLM2 has 3 KV heads: 4 ranks can neither split nor evenly replicate them
    with pytest.raises(ValueError, match="must be a multiple of the model's 3 KV heads"):
        LLM(MODEL, dtype="float32", num_blocks=64, max_model_len=512, tensor_parallel_size=4)


def test_engine_command_refuses_a_bad_tensor_parallel_size() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli.main", "engine", "--tensor-parallel-size", "0"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert "tensor_parallel_size must be at least 1" in result.stderr


def test_a_script_without_a_main_guard_runs_two_ranks(
    tiny_config: Callable[..., Path], tmp_path: Path
) -> None:
    """Issue 28: `LLM(tensor_parallel_size=2)` at a script's top level, as the README's
    offline example does for one GPU, made every spawned worker run the script again and die
    ("worker rank 1 ... exited with code 1"); with a guard, exiting printed "exited with code
    None" as if a worker had died. Now it generates as TP=1 does and exits quietly."""
    path = tiny_config()
    prompts = [list(range(1, 2 + 3 * i)) for i in range(3)]
    expected = [
        list(o.outputs[0].token_ids)
        for o in generate(1, str(path), prompts, load_format="dummy", skip_tokenizer_init=True)
    ]
    script = tmp_path / "offline.py"
    script.write_text(
        "from kvfleet.engine.llm import LLM\n"
        "from kvfleet.engine.sampling_params import SamplingParams\n"
        f"llm = LLM({str(path)!r}, load_format='dummy', skip_tokenizer_init=True,\n"
        "          dtype='float32', num_blocks=512, max_model_len=512, tensor_parallel_size=2)\n"
        "params = SamplingParams(temperature=0, max_tokens=64, logprobs=5, ignore_eos=True)\n"
        f"for out in llm.generate({prompts!r}, params):\n"
        "    print('TOKENS', list(out.outputs[0].token_ids))\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert printed == [f"TOKENS {tokens}" for tokens in expected]  # once: no rank re-ran it
    assert "exited with code" not in run.stderr
