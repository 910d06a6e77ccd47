"""The startup step that has Triton compile the prefill attention variants
(engine/worker/cuda_graphs.py, `warm_up_prefill_kernels`) on the CPU's torch kernels: it writes
only into the null block, so no live K/V changes (the compile itself is proven on the device,
tests/gpu)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_prompt import PROMPT_TILES, prompt_step_kind
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.worker.cuda_graphs import DecodeGraphs
from kvfleet.engine.worker.model_runner import ModelRunner
from kvfleet.engine.worker.setup import load_rank_model, resolve_setup


def test_the_warm_up_steps_touch_only_the_null_block(tiny_config: Callable[..., Path]) -> None:
    path = tiny_config(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config = EngineConfig(model=str(path), load_format="dummy", device="cpu", dtype="float32")
    setup = resolve_setup(config)
    runner = ModelRunner(load_rank_model(config, setup, None), 16, setup.dtype, setup.device)
    runner.allocate_kv_cache(8)
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 4, setup.device)
    graphs.warm_up_prefill_kernels()
    for cache, old in zip(runner.kv_caches, before, strict=True):
        # [2, num_blocks, block_size, kv_heads, head_dim]: block 0 is the null block
        assert torch.equal(cache[:, 1:], old[:, 1:])
        assert not torch.equal(cache[:, 0], old[:, 0])  # (the steps did run)


def test_the_warm_up_steps_cover_every_kind_of_prompt_tile() -> None:
    """A kind of step no warm-up step has would compile its tile mid-serving."""
    kinds = set()
    for q, cached in DecodeGraphs.WARM_STEPS:
        metadata = AttentionMetadata.one_prompt(
            torch.zeros(q, dtype=torch.int64), torch.zeros(512, dtype=torch.int32), cached
        )
        kinds.add(prompt_step_kind(metadata))
    assert kinds == {kind for _, kind in PROMPT_TILES}
