"""A step's tail compiled at startup: one row's logits (the LM head's Triton GEMV,
`linear.float32_logits`) and the vocabulary race that samples them (sample/gumbel_race.py).
Triton compiles a kernel at its first launch, and without this the first request a server
takes waited for both: on the H200 each new engine's first lone prompt (the online run's first
request, its p99) and its first sampled token (bench/RESULTS.md, session 34). The GPU test
of no compile mid-serving serves its first requests with no warm-up of its own."""

from __future__ import annotations

import torch

from kvfleet.engine.worker.model_runner import ModelRunner


@torch.inference_mode()
def warm_up_step_tail(runner: ModelRunner) -> None:
    """One row's logits of this rank's vocabulary shard, raced (CUDA only: elsewhere neither
    kernel runs; no collective, so each rank may run it alone)."""
    if runner.device.type != "cuda":
        return
    from kvfleet.engine.sample.gumbel_race import race

    row = torch.zeros((1, runner.config.hidden_size), dtype=runner.dtype, device=runner.device)
    logits = runner.model.compute_logits(row, gather=False)
    first, count = runner.vocab_columns
    zero = torch.zeros(1, dtype=torch.int64, device=runner.device)
    # (greedy and sampled rows are one compiled kernel: the temperature is read, not constant)
    race(logits, torch.ones(1, dtype=torch.float64, device=runner.device), zero, zero, first, count)
