"""The vocabulary race (engine/sample/gumbel_race.py) compiled for the GPU: 200,000 draws follow
softmax(logits / T) at two temperatures (chi-square), greedy rows are argmax, a whole
vocabulary of Llama-3's size splits into shards that agree with it, and a seeded row draws the
same token by the race or by the torch sampler."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from scipy import stats  # noqa: E402

from kvfleet.engine.sample.gumbel_race import race, winners  # noqa: E402
from kvfleet.engine.sample.torch_sampler import Sampler, SamplingMetadata, position_seed  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], device="cuda")


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_draws_follow_softmax(temperature: float) -> None:
    num = 200_000
    logits = LOGITS.repeat(num, 1)
    t = torch.full((num,), temperature, dtype=torch.float64, device="cuda")
    keys = torch.full((num,), 77, device="cuda")
    bases = torch.arange(num, device="cuda") * 8
    observed = torch.bincount(winners(race(logits, t, keys, bases)), minlength=8).double().cpu()
    expected = (LOGITS.double().cpu() / temperature).softmax(-1) * num
    result = stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (observed, expected)


def test_greedy_and_shards_at_llama3_vocabulary() -> None:
    vocab, rows = 128_256, 64
    logits = torch.randn(
        rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    t = torch.where(torch.arange(rows, device="cuda") % 2 == 0, 0.0, 1.0).double()
    keys = torch.full((rows,), 5, device="cuda")
    bases = torch.arange(rows, device="cuda") * vocab
    whole = race(logits, t, keys, bases)
    assert torch.equal(winners(whole)[0::2], logits.argmax(-1)[0::2])
    half = vocab // 2
    shards = [
        race(logits[:, s : s + half].contiguous(), t, keys, bases, s, half) for s in (0, half)
    ]
    assert torch.equal(torch.maximum(*shards), whole)


def test_seeded_rows_draw_the_same_token_by_the_race_or_by_the_torch_sampler() -> None:
    rows, vocab = 64, 128_256
    logits = torch.randn(
        rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    temperatures = [0.5 + (row % 4) * 0.3 for row in range(rows)]
    keys = [position_seed(11, 100 + row) for row in range(rows)]
    raced = winners(
        race(
            logits,
            torch.tensor(temperatures, dtype=torch.float64, device="cuda"),
            torch.tensor(keys, device="cuda"),
            torch.zeros(rows, dtype=torch.int64, device="cuda"),
        )
    )
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=t, seed=11) for t in temperatures],
        [[]] * rows,
        [[]] * rows,
        {row: torch.Generator("cuda").manual_seed(key) for row, key in enumerate(keys)},
        vocab,
        torch.device("cuda"),
    )
    assert torch.equal(Sampler()(logits, meta).sampled_token_ids, raced)


def test_logit_bias_on_the_device_at_llama3_vocabulary() -> None:
    """`logit_bias` on CUDA tensors (the torch path: the race cannot apply it): a +100 bias
    makes a token certain in a sampled row, -100 removes a greedy row's argmax, and a row
    without one keeps its own argmax."""
    vocab, rows = 128_256, 3
    logits = torch.randn(
        rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    top = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=1.0, logit_bias={vocab - 1: 100}),
        SamplingParams(temperature=0, logit_bias={top: -100}),
        SamplingParams(temperature=0),
    ]
    meta = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, {}, vocab, torch.device("cuda"))
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    second = logits[1].clone()
    second[top] -= 100
    assert out == [vocab - 1, int(second.argmax()), int(logits[2].argmax())]
