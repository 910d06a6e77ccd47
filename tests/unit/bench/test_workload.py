"""The workload generator and the floor counting of the benchmarks, against hand counts."""

from __future__ import annotations

import pytest

from kvfleet.bench.workload import (
    Workload,
    experts_read,
    kv_bytes_per_token,
    layer_matmul_params,
    parse_range,
    random_workload,
    weight_bytes_per_step,
    workload_cost,
)
from kvfleet.engine.config import ModelConfig

TINY = ModelConfig(
    architecture="llama",
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def test_parse_range() -> None:
    assert parse_range("256") == (256, 256)
    assert parse_range("128:1024") == (128, 1024)
    for bad in ("0", "9:3", "x"):
        with pytest.raises(ValueError):  # noqa: PT011 - int() and our own message alike
            parse_range(bad)


def test_random_workload_is_seeded_and_in_range() -> None:
    a = random_workload(20, (5, 9), (3, 4), vocab_size=1000, seed=7)
    b = random_workload(20, (5, 9), (3, 4), vocab_size=1000, seed=7)
    assert a == b
    assert a != random_workload(20, (5, 9), (3, 4), vocab_size=1000, seed=8)
    assert all(5 <= len(p) <= 9 for p in a.prompts)
    assert all(3 <= n <= 4 for n in a.output_lens)
    assert all(100 <= t < 900 for p in a.prompts for t in p)


def test_cost_matches_a_hand_count() -> None:
    # Per layer: qkv 64 x (64 + 2 x 32), o 64 x 64, gate/up/down 3 x 64 x 128.
    per_layer = 64 * 128 + 64 * 64 + 3 * 64 * 128
    assert layer_matmul_params(TINY) == 2 * per_layer
    # K and V x kv heads x head dim x bytes x layers.
    assert kv_bytes_per_token(TINY, 2) == 2 * 2 * 16 * 2 * 2
    assert weight_bytes_per_step(TINY, 2) == (2 * per_layer + 5 * 64 + 1000 * 64) * 2

    workload = Workload(prompts=[[1, 2, 3]], output_lens=[2])
    cost = workload_cost(TINY, 2, workload, max_num_seqs=8)
    # 5 tokens through the layers, 2 sampled through the LM head; attention pairs: prompt
    # 1 + 2 + 3 = 6, decode tokens see 4 and 5 positions.
    pair = 4 * 4 * 16 * 2
    assert cost.flops == 2 * 2 * per_layer * 5 + 2 * 64 * 1000 * 2 + pair * (6 + 4 + 5)
    kv_token = kv_bytes_per_token(TINY, 2)
    # 2 steps of weights; KV: 5 written, 3 read by the prompt, 4 + 5 read by the decodes.
    assert cost.bytes == 2 * weight_bytes_per_step(TINY, 2) + kv_token * (5 + 3 + 9)


def test_steps_grow_when_requests_outnumber_the_batch() -> None:
    workload = Workload(prompts=[[1]] * 10, output_lens=[4] * 10)
    few = workload_cost(TINY, 2, workload, max_num_seqs=2)  # 40 tokens, 2 a step: 20 steps
    many = workload_cost(TINY, 2, workload, max_num_seqs=16)  # 4 steps
    assert few.bytes - many.bytes == 16 * weight_bytes_per_step(TINY, 2)


@pytest.mark.parametrize("command", ["throughput", "serve"])
def test_bench_cli_rejects_a_bad_length(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet.cli.main import main

    assert main(["bench", command, "--input-len", "9:3"]) == 1
    assert "LOW:HIGH" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["latency", "--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["latency", "--output-len", "1"], "--output-len: must be at least 2, got 1"),
        (["latency", "--lora-share", "1.5"], "--lora-share: must be between 0 and 1, got 1.5"),
        (["latency", "--num-loras", "x"], "--num-loras: not an integer: 'x'"),
        (["throughput", "--num-prompts", "-3"], "--num-prompts: must be at least 1, got -3"),
        (["speculative", "--repeats", "0"], "--repeats: must be at least 1, got 0"),
        (["structured", "--tokenizer", "t", "--output-len", "1"], "must be at least 2"),
        (["serve", "--max-concurrency", "0"], "--max-concurrency: must be at least 1, got 0"),
    ],
)
def test_bench_cli_rejects_absurd_counts(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (a batch of 0 or an output of 1 token once gave a report of -0.0 ms a token)
    from kvfleet.cli.main import main

    with pytest.raises(SystemExit) as stopped:
        main(["bench", *args])
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err


def test_bench_latency_refuses_a_context_shorter_than_its_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfleet.cli.main import main

    assert main(["bench", "latency", "--max-model-len", "200"]) == 1
    assert "--max-model-len 200 is shorter than --input-len + --output-len (256)" in (
        capsys.readouterr().err
    )


def test_a_mixture_of_experts_is_counted_by_what_a_token_reads() -> None:
    """Qwen3-30B-A3B's shape: 29.9B layer matmul weights stored, 2.7B multiplied per token
    (3.3B "active" with the embeddings and LM head, as Qwen counts); a step of one token reads
    its 8 experts per layer, a step of 256 nearly all 128."""
    from kvfleet.engine.loader.source import resolve_model_source

    config = resolve_model_source("qwen3-30b-a3b", "dummy").read_config()
    stored, active = layer_matmul_params(config), layer_matmul_params(config, active=True)
    assert 29.8e9 < stored < 30.0e9
    assert 2.6e9 < active < 2.8e9
    assert experts_read(config, 1) == pytest.approx(8)
    assert experts_read(config, 256) == pytest.approx(128, abs=0.01)
    expert_bytes = 48 * 3 * 2048 * 768 * 2
    assert weight_bytes_per_step(config, 2, 1) == pytest.approx(
        weight_bytes_per_step(config, 2) - 120 * expert_bytes
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--rounds", "0"], "--rounds: must be at least 1, got 0"),
        (["--decodes", "0", "-2"], "--decodes: must be at least 0, got -2"),
        (["--input-len", "0"], "--input-len: must be at least 1, got 0"),
    ],
)
def test_mixed_ttft_rejects_absurd_counts(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (no rounds once meant a median of nothing)
    from kvfleet.bench.mixed_ttft import parser

    with pytest.raises(SystemExit) as stopped:
        parser().parse_args(args)
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err
