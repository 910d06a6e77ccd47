"""TPPlan: every weight row and column lands on exactly one rank (or, for KV heads fewer than the
ranks, on the ranks sharing it), whatever the split."""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.parallel.partition import TPPlan, even_span

BASE = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def plans(config: ModelConfig, world_size: int) -> list[TPPlan]:
    return [TPPlan.build(config, rank, world_size) for rank in range(world_size)]


def test_even_span_covers_everything_once() -> None:
    for total in (1, 3, 7, 64):
        for world in (1, 2, 3, 4, 8):
            spans = [even_span(total, r, world) for r in range(world)]
            covered = [i for s in spans for i in range(s.start, s.start + s.size)]
            assert covered == list(range(total))
            assert max(s.size for s in spans) - min(s.size for s in spans) <= 1


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_smollm2_shapes_split_by_whole_gqa_groups(world_size: int) -> None:
    parts = plans(BASE, world_size)
    q = [h for p in parts for h in range(p.q_heads.start, p.q_heads.start + p.q_heads.size)]
    kv = [h for p in parts for h in range(p.kv_heads.start, p.kv_heads.start + p.kv_heads.size)]
    assert q == list(range(9))
    assert kv == list(range(3))
    for p in parts:  # a rank's query heads read only its own KV heads
        assert p.q_heads.start == p.kv_heads.start * 3
        assert p.q_heads.size == p.kv_heads.size * 3
    assert sum(p.intermediate.size for p in parts) == 1536
    assert sum(p.vocab.size for p in parts) == 49152
    assert all(p.vocab_per_rank * world_size >= 49152 for p in parts)


def test_two_ranks_split_smollm2_unevenly() -> None:
    first, second = plans(BASE, 2)
    assert (first.kv_heads.size, second.kv_heads.size) == (2, 1)
    assert first.slice_for("model.layers.0.self_attn.q_proj.weight") == (0, 0, 6 * 64)
    assert second.slice_for("model.layers.0.self_attn.k_proj.weight") == (0, 2 * 64, 64)
    assert second.slice_for("model.layers.3.self_attn.o_proj.weight") == (1, 6 * 64, 3 * 64)
    assert first.slice_for("model.layers.1.mlp.down_proj.weight") == (1, 0, 768)
    assert second.slice_for("model.embed_tokens.weight") == (0, 24576, 24576)
    assert first.slice_for("model.layers.0.input_layernorm.weight") is None
    assert first.slice_for("model.layers.0.self_attn.o_proj.bias") is None  # added once


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    config = dataclasses.replace(BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=72)
    parts = plans(config, 4)
    assert [p.kv_heads.start for p in parts] == [0, 0, 1, 1]
    assert [(p.q_heads.start, p.q_heads.size) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_unsplittable_shapes_are_refused() -> None:
    config = dataclasses.replace(BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=72)
    with pytest.raises(ValueError, match="multiple of the model's 2 KV heads"):
        TPPlan.build(config, 0, 3)
    single = dataclasses.replace(BASE, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        TPPlan.build(single, 0, 4)
