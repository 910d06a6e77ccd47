"""Steps with prompt tokens in pieces around attention (engine/worker/prefill_graphs.py) on the
CPU: the forward the pieces compute (`forward_in_pieces`: the static buffers, each layer's
attention at its break, what a replay of the captured pieces does) gives the plain forward's
hidden states and K/V, padding tokens writing only into the null block even after a larger
step left live slots in the static slot mapping. The capture and replay themselves need CUDA:
tests/gpu/test_prefill_graphs_cuda.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.lora.layers import LoRAContext, attach_lora
from kvfleet.engine.lora.ops import LoRABatch
from kvfleet.engine.worker.model_runner import ModelRunner
from kvfleet.engine.worker.prefill_graphs import PrefillGraphs, buckets
from kvfleet.engine.worker.setup import load_rank_model, resolve_setup

BLOCK = 16


@pytest.fixture(params=["torch", "triton"])
def runner(tiny_config: Callable[..., Path], request: pytest.FixtureRequest) -> ModelRunner:
    """A tiny model on the CPU through either attention backend (Triton's interpreted)."""
    path = tiny_config(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config = EngineConfig(model=str(path), load_format="dummy", device="cpu", dtype="float32")
    setup = resolve_setup(config)
    model = load_rank_model(config, setup, None)
    if request.param == "triton":  # (the engine runs it on CUDA only: swapped in here)
        from kvfleet.engine.attention.triton_attention import TritonAttention

        for layer in model.layers:
            old = layer.self_attn.backend
            layer.self_attn.backend = TritonAttention(
                old.num_heads, old.num_kv_heads, old.head_dim, old.sliding_window, old.scale
            )
    made = ModelRunner(model, BLOCK, setup.dtype, setup.device)
    made.allocate_kv_cache(8)
    for cache in made.kv_caches:
        cache.normal_()
    return made


def _step(
    lengths: list[tuple[int, int, list[int]]],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of sequences given as (cached tokens, new tokens,
    blocks), decodes first."""
    ids, positions, slots, tables, cu, seq_lens = [], [], [], [], [0], []
    for cached, new, blocks in lengths:
        for position in range(cached, cached + new):
            ids.append(7 * position % 500 + 1)
            positions.append(position)
            slots.append(blocks[position // BLOCK] * BLOCK + position % BLOCK)
        tables.append(blocks + [0] * (3 - len(blocks)))
        cu.append(cu[-1] + new)
        seq_lens.append(cached + new)
    query_lens = [new for _, new, _ in lengths]
    metadata = AttentionMetadata(
        torch.tensor(slots),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        max(query_lens),
        max(seq_lens),
        query_lens,
        seq_lens,
        num_decodes=sum(1 for n in query_lens if n == 1),
    )
    return torch.tensor(ids), torch.tensor(positions), metadata


def test_a_forward_in_pieces_equals_the_plain_forward(runner: ModelRunner) -> None:
    graphs = PrefillGraphs(runner.model, runner.kv_caches, 16, runner.device)
    plain_caches = [cache.clone() for cache in runner.kv_caches]
    steps = [
        _step([(20, 12, [1, 2])]),  # (a prompt chunk after a cached prefix: 12 of 16 slots)
        _step([(5, 1, [3]), (16, 7, [4, 5])]),  # (a decode beside a chunk: 8 of 16 slots)
    ]
    for input_ids, positions, metadata in steps:
        # Blocks 1-2 freed and given to another request since: new contents, which the first
        # step's slots, stale in the static buffer past this step's tokens, must not reach.
        for cache, plain in zip(runner.kv_caches, plain_caches, strict=True):
            cache[:, 1:3].normal_()
            plain[:, 1:3] = cache[:, 1:3]
        want = runner.model(input_ids, positions, plain_caches, metadata)
        got = graphs.forward_in_pieces(input_ids, positions, metadata)
        assert torch.equal(got, want)
        for cache, plain in zip(runner.kv_caches, plain_caches, strict=True):
            # [2, num_blocks, block_size, kv_heads, head_dim]: block 0 is the null block
            assert torch.equal(cache[:, 1:], plain[:, 1:])
    for attention in graphs.attentions:
        assert attention.backend.graph_break is None


def test_a_forward_in_pieces_with_adapters_equals_the_plain_forward(runner: ModelRunner) -> None:
    context = LoRAContext(use_triton=True)  # (the pieces' LoRA path: the Triton kernels)
    generator = torch.Generator().manual_seed(0)
    for layer in attach_lora(runner.model, 2, 4, context):
        layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=generator) / 4)
        layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=generator) / 4)
    graphs = PrefillGraphs(runner.model, runner.kv_caches, 16, runner.device, (context, 2))
    # a decode on adapter 1 beside a chunk on adapter 0, and the base model's prompt
    # (12 tokens: CPU matmuls of 11 rows and of 16 differ in the last 3 by an ulp)
    input_ids, positions, metadata = _step([(5, 1, [3]), (16, 7, [4, 5]), (0, 4, [6])])
    batch = LoRABatch.build(np.array([1] + [0] * 7 + [2] * 4), 2, runner.device)
    assert batch is not None
    plain_caches = [cache.clone() for cache in runner.kv_caches]
    without = runner.model(input_ids, positions, [c.clone() for c in plain_caches], metadata)
    context.batch = batch
    want = runner.model(input_ids, positions, plain_caches, metadata)
    context.batch = None
    assert not torch.allclose(want[:8], without[:8], atol=1e-3)  # (the adapters do something)
    assert torch.equal(want[8:], without[8:])
    got = graphs.forward_in_pieces(input_ids, positions, metadata, batch)
    assert torch.equal(got, want)
    for cache, plain in zip(runner.kv_caches, plain_caches, strict=True):
        assert torch.equal(cache[:, 1:], plain[:, 1:])
    assert context.batch is None
    assert graphs.can_run(16, with_lora=True)
    # the same tokens without adapters next: the static grouping left behind is not read
    assert torch.equal(graphs.forward_in_pieces(input_ids, positions, metadata), without)


def test_buckets_pad_a_large_step_by_less_than_a_step_of_them() -> None:
    assert buckets(32) == [16, 32]
    assert buckets(100) == [16, 32, 64, 100]
    assert buckets(512) == [16, 32, 64, 128, 256, 512]
    assert buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert buckets(1100) == [16, 32, 64, 128, 256, 512, 768, 1024, 1100]


def test_steps_it_cannot_replay_run_eagerly(runner: ModelRunner) -> None:
    graphs = PrefillGraphs(runner.model, runner.kv_caches, 32, runner.device)
    assert graphs.buckets == [16, 32]
    assert graphs.can_run(32, with_lora=False)
    assert not graphs.can_run(33, with_lora=False)
    assert not graphs.can_run(8, with_lora=True)
    graphs.attentions[1].calibrate_kv = True  # (an FP8 KV cache's scales, still to measure)
    assert not graphs.can_run(8, with_lora=False)
    input_ids, positions, metadata = _step([(0, 9, [1])])
    graphs.forward_in_pieces(input_ids, positions, metadata)
    assert graphs.attentions[1].calibrate_kv  # (the pieces measured nothing)
