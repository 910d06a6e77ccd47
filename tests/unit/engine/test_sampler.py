"""The batched sampler: each knob, seeds, logprobs, and temperature sampling against softmax."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from kvfleet.engine.sample.torch_sampler import Sampler, SamplingMetadata
from kvfleet.engine.sampling_params import SamplingParams

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def meta(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in params],
        outputs or [[] for _ in params],
        generators or {},
        VOCAB,
        torch.device("cpu"),
    )


def draw(params: SamplingParams, num: int, seed: int = 0) -> torch.Tensor:
    """`num` samples from LOGITS in one batch of `num` identical rows."""
    torch.manual_seed(seed)
    logits = LOGITS.repeat(num, 1)
    return Sampler()(logits, meta([params] * num)).sampled_token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, meta([SamplingParams(temperature=0)] * 5))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_temperature_matches_softmax() -> None:
    """Chi-square goodness of fit of 40,000 draws at T=0.7 against softmax(logits / T)."""
    num = 40_000
    samples = draw(SamplingParams(temperature=0.7), num)
    observed = torch.bincount(samples, minlength=VOCAB).double()
    probs = (LOGITS.double() / 0.7).softmax(-1)
    expected = probs / probs.sum() * observed.sum()
    result = stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (observed, expected)


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=1), {0}),
        # softmax(LOGITS) ~ [.405, .245, .149, .090, ...]: .405 + .245 = .650.
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.66), {0, 1, 2}),
        # min_p keeps p >= 0.3 * p_max, i.e. logits >= 2 + ln 0.3 = 0.796.
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(top_k=5, top_p=0.99, min_p=0.1), {0, 1, 2, 3, 4}),
    ],
)
def test_filters_restrict_the_support(params: SamplingParams, support: set[int]) -> None:
    assert set(draw(params, 5000).tolist()) == support


def test_top_k_renormalizes() -> None:
    samples = draw(SamplingParams(top_k=2), 20_000)
    share = float((samples == 0).double().mean())
    expected = math.exp(2.0) / (math.exp(2.0) + math.exp(1.5))
    assert abs(share - expected) < 0.015


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    m = meta([params], prompts=[[0]], outputs=[[1, 2, 2]])
    from kvfleet.engine.sample.torch_sampler import apply_penalties

    out = apply_penalties(logits, m)[0]
    # token 0: prompt only -> 2 / 2; token 1: negative, once in output -> -2 * 2 - 0.5 - 0.25;
    # token 2: twice in output -> 1 / 2 - 2 * 0.5 - 0.25; token 3 untouched.
    assert out[:4].tolist() == pytest.approx([1.0, -4.75, -0.75, 1.0])
    # Greedy picks the best penalized token: 0 and 3 tie at 1.0, argmax takes the first.
    assert Sampler()(logits, m).sampled_token_ids.tolist() == [0]


def test_seeded_rows_repeat_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=7)
    free = SamplingParams(temperature=1.0)

    def sample(rows: list[SamplingParams], seeded_row: int) -> int:
        generator = torch.Generator().manual_seed(7)
        logits = torch.zeros(len(rows), VOCAB)
        out = Sampler()(logits, meta(rows, generators={seeded_row: generator}))
        return int(out.sampled_token_ids[seeded_row])

    alone = [sample([seeded], 0) for _ in range(3)]
    crowded = [sample([free, free, seeded], 2) for _ in range(3)]
    assert alone == crowded
    assert len(set(alone)) == 1


def test_logprobs_and_ranks() -> None:
    logits = LOGITS.repeat(2, 1)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(top_k=1, logprobs=0)]
    out = Sampler()(logits, meta(params))
    reference = LOGITS.log_softmax(-1)
    assert out.logprobs is not None
    assert out.logprob_token_ids is not None
    assert out.logprob_token_ids[0].tolist() == [0, 0, 1, 2]
    assert out.logprobs[0].tolist() == pytest.approx(reference[[0, 0, 1, 2]].tolist())
    assert out.sampled_ranks is not None
    assert out.sampled_ranks.tolist() == [1, 1]


def test_logit_bias_steers_greedy_and_sampled_rows() -> None:
    logits = LOGITS.repeat(3, 1)
    rows = [
        SamplingParams(temperature=0, logit_bias={0: -100}),  # the argmax is excluded
        SamplingParams(temperature=0, logit_bias={6: 4.5}),  # -1.0 + 4.5 beats 2.0
        SamplingParams(temperature=1.0, logit_bias={7: 100}),  # certain
    ]
    out = Sampler()(logits, meta(rows))
    assert out.sampled_token_ids.tolist() == [1, 6, 7]
    # bounded as OpenAI bounds it, and checked where it is given
    assert SamplingParams(logit_bias={3: 1e6}).logit_bias == {3: 100.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1.0})  # type: ignore[dict-item]
    # (the race cannot apply it, and drafts are not verified under it)
    assert SamplingParams(logit_bias={3: 1.0}).needs_distribution
    assert not SamplingParams(logit_bias={3: 1.0}).may_speculate


def test_a_speculative_step_applies_a_greedy_requests_logit_bias() -> None:
    """A step with drafts takes each row's argmax alone only when nothing changes it: a greedy
    request with a logit bias beside a drafting one is verified with its bias applied."""
    from dataclasses import dataclass

    from kvfleet.engine.sample.batch import ArgmaxBatch, DraftBatch, SamplingPlanner
    from kvfleet.engine.sample.sampler import sample

    @dataclass
    class Row:
        req_id: str
        sampling_params: SamplingParams
        token_ids: list[int]
        num_prompt_tokens: int = 2
        generator: torch.Generator | None = None

    planner = SamplingPlanner(VOCAB, torch.device("cpu"))
    plain = Row("a", SamplingParams(temperature=0), [1, 2, 3])
    other = Row("b", SamplingParams(temperature=0), [1, 2, 3])
    assert isinstance(planner.plan([plain, other], [3, 3], [[0, 0], []]), ArgmaxBatch)
    biased = Row("b", SamplingParams(temperature=0, logit_bias={5: 100}), [1, 2, 3])
    batch = planner.plan([plain, biased], [3, 3], [[0, 0], []])
    assert isinstance(batch, DraftBatch)
    out = sample(LOGITS.repeat(4, 1), batch)  # 3 rows for the drafting request, 1 for the other
    assert out.sampled_token_ids.tolist() == [0, 5]  # (its drafts, both 0, were all kept)
    assert out.num_accepted is not None
    assert out.num_accepted.tolist() == [2, 0]
