"""The vocabulary race (engine/sample/gumbel_race.py) under TRITON_INTERPRET on CPU: greedy rows are
argmax (ties to the lower index), shards raced apart agree with the whole, a seeded row's draw
depends only on its key, and temperature sampling follows softmax(logits / T).

The interpreter runs ~10 ms per program, so the statistical test here is small; the GPU test
(tests/gpu/test_triton_cuda.py) draws 200,000 samples.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

pytest.importorskip("triton")

from kvfleet.engine.sample.gumbel_race import race, winners

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def run(
    logits: torch.Tensor,
    temperatures: list[float],
    keys: list[int],
    bases: list[int],
    first: int = 0,
    count: int | None = None,
) -> torch.Tensor:
    return race(
        logits,
        torch.tensor(temperatures, dtype=torch.float64),
        torch.tensor(keys),
        torch.tensor(bases),
        first,
        count,
    )


def test_greedy_rows_are_argmax_with_ties_to_the_lower_index() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 250] = 99.0  # a tie: the first wins, as torch.argmax picks
    logits[2] = -5.0  # all equal, negative
    logits[3, 299] = 1e30
    got = winners(run(logits, [0.0] * 4, [1] * 4, [0] * 4))
    assert got.tolist() == logits.argmax(-1).tolist() == [got[0].item(), 7, 0, 299]


def test_shards_raced_apart_agree_with_the_whole() -> None:
    """Tensor parallelism: each rank races its columns (global indices); the max decides."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)) * 3
    temperatures = [0.0, 1.0, 0.7, 2.0, 0.0, 1.0]
    keys, bases = [11, 12, 12, 13, 14, 99], [0, 0, 1000, 2000, 0, 5000]
    whole = run(logits, temperatures, keys, bases)
    # uneven shards, the last padded with columns beyond the vocabulary
    padded = torch.cat([logits, torch.full((6, 83), 50.0)], dim=1)
    parts = [(0, 400), (400, 400), (800, 200)]
    shards = [
        run(padded[:, s : s + 400].contiguous(), temperatures, keys, bases, s, n) for s, n in parts
    ]
    combined = torch.stack(shards).amax(0)
    assert torch.equal(combined, whole)
    assert winners(combined).max().item() < 1000


def test_shards_on_odd_columns_draw_the_whole_rows_noise() -> None:
    """A column's noise is its stream offset's (base + global index), wherever its program's
    block starts: shards at odd first columns and rows at odd bases (blocks not on a multiple
    of 4) race as the whole row does."""
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(4))
    temperatures, keys, bases = [1.0, 0.8, 1.0, 1.5], [21, 22, 22, 23], [0, 3, 701, 1402]
    whole = run(logits, temperatures, keys, bases)
    parts = [(0, 333), (333, 250), (583, 117)]
    shards = [run(logits[:, s : s + n].contiguous(), temperatures, keys, bases, s, n)
              for s, n in parts]  # fmt: skip
    assert torch.equal(torch.stack(shards).amax(0), whole)


def test_seeded_row_depends_only_on_its_key() -> None:
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    alone = winners(run(logits, [1.0], [1234], [0]))
    others = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    batch = torch.cat([others[:2], logits, others[2:]])
    inside = winners(run(batch, [0.5, 1.0, 1.0, 1.0], [9, 9, 1234, 9], [0, 500, 0, 1500]))
    assert inside[2] == alone[0]
    # another key draws other noise: over a few keys, not always the same token
    draws = {int(winners(run(logits, [1.0], [k], [0]))[0]) for k in range(12)}
    assert len(draws) > 1


def test_temperature_follows_softmax() -> None:
    """Chi-square goodness of fit of 600 draws (one step key, a stretch of it per row)."""
    num = 600
    logits = LOGITS.repeat(num, 1)
    samples = winners(run(logits, [0.7] * num, [5] * num, [8 * r for r in range(num)]))
    observed = torch.bincount(samples, minlength=8).double()
    probs = (LOGITS.double() / 0.7).softmax(-1)
    # the tail bins (expected counts under 5) merged into one
    observed = torch.cat([observed[:5], observed[5:].sum(0, keepdim=True)])
    expected = torch.cat([probs[:5], probs[5:].sum(0, keepdim=True)]) * num
    result = stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (observed, expected)


def test_a_seeded_row_draws_the_same_token_by_the_race_or_by_the_torch_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a plain step races the logits unless a row of its batch needs the distribution,
    when the torch sampler takes every row (and a speculative step verifies with it): a seeded
    row's token must not depend on which (the keyed draw is the race's on both paths)."""
    from kvfleet.engine.sample import torch_sampler as sampler_module
    from kvfleet.engine.sample.torch_sampler import Sampler, SamplingMetadata, position_seed
    from kvfleet.engine.sampling_params import SamplingParams

    monkeypatch.setattr(sampler_module, "_draws_by_race", lambda device: True)  # (as on CUDA)
    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 2
    temperatures = [1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 0.9]
    keys = [position_seed(7, 40 + row) for row in range(rows)]
    raced = winners(run(logits, temperatures, keys, [0] * rows))
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=t, seed=7) for t in temperatures],
        [[]] * rows,
        [[]] * rows,
        {row: torch.Generator().manual_seed(key) for row, key in enumerate(keys)},
        vocab,
        torch.device("cpu"),
    )
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert sampled.tolist() == raced.tolist()
    assert len(set(raced.tolist())) > 1  # (not all one token)
