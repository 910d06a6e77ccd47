"""Speculative decoding's pieces: the n-gram proposer against a brute-force search, and the
rejection sampler: greedy requests emit exactly the target's argmax tokens, sampled ones the
target's distribution (chi-square over many draws, with draft-model and with certain drafts,
seeded or not, at temperature 1 and under top-p); seeded ones their own samples."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest
import torch
from scipy import stats

from kvfleet.engine.config import SpeculativeConfig
from kvfleet.engine.core.request import Request, RequestId
from kvfleet.engine.sample.rejection import emitted_tokens, verify_drafts
from kvfleet.engine.sample.torch_sampler import (
    Sampler,
    SamplingMetadata,
    filtered_probs,
    keyed_exponential_race,
    position_seed,
)
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.spec_decode.adaptive import (
    DraftLength,
    Rate,
    StepCosts,
    choose_num_drafts,
    expected_tokens,
)
from kvfleet.engine.spec_decode.ngram import NgramProposer
from kvfleet.engine.spec_decode.proposer import Proposer
from kvfleet.engine.spec_decode.speculator import Speculator


def rejection_sample(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    greedy: list[bool],
    num_drafts: list[int],
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    keys: dict[int, list[int]] | None = None,
) -> list[list[int]]:
    """The tokens each request emits."""
    kept, last = verify_drafts(
        target_probs, target_argmax, greedy, num_drafts, draft_token_ids, draft_probs, keys
    )
    return emitted_tokens(draft_token_ids.tolist(), num_drafts, kept.tolist(), last.tolist())


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposals_follow_the_latest_longest_match() -> None:
    proposer = NgramProposer(1, 3)
    # "a b c d | a b c" -> the 3-gram a b c matched, d follows
    assert proposer.draft("r", [1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]
    # a longer match beats a later shorter one: [7 8] once followed by 5, [8] later by 6
    assert proposer.draft("s", [7, 8, 5, 0, 8, 6, 1, 7, 8], 1) == [5]
    assert proposer.draft("t", [1, 2, 3], 4) == []  # nothing repeats
    assert proposer.draft("u", [5, 5], 3) == [5]  # (only one token after the earlier 5)
    assert proposer.draft("r", [1, 2, 3, 4, 9, 1, 2, 3, 4], 0) == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_grown_token_by_token_equals_a_fresh_search(seed: int) -> None:
    rng = random.Random(seed)
    proposer = NgramProposer(2, 4)
    tokens = [rng.randrange(4) for _ in range(5)]
    for _ in range(120):
        assert proposer.draft("r", tokens, 3) == brute_force(tokens, 2, 4, 3)
        tokens.append(rng.randrange(4))
    proposer.forget([RequestId("r"), RequestId("never-seen")])


def test_greedy_requests_keep_drafts_up_to_the_first_mismatch() -> None:
    vocab = 10
    argmax = torch.tensor([3, 4, 5, 6, 1, 2, 7, 8, 0, 9])  # rows: 3 + 1 + 5 + 1
    probs = torch.full((10, vocab), 1.0 / vocab)
    drafts = torch.tensor([3, 4, 0, 1, 2, 7])  # req 0: 3 4 | req 2: 0 1 2 7 (rejected at 0)
    emitted = rejection_sample(probs, argmax, [True, True, True, True], [2, 0, 4, 0], drafts)
    assert emitted == [[3, 4, 5], [6], [1], [9]]
    drafts = torch.tensor([3, 9, 1, 2, 7, 8])  # req 0 rejected at its second draft
    emitted = rejection_sample(probs, argmax, [True, True, True, True], [2, 0, 4, 0], drafts)
    assert emitted == [[3, 4], [6], [1, 2, 7, 8, 0], [9]]


def test_greedy_requests_stay_exact_beside_sampled_ones() -> None:
    vocab = 10
    argmax = torch.tensor([3, 4, 5, 6, 1, 2])  # rows: 3 (greedy) + 3 (sampled)
    probs = torch.full((6, vocab), 1.0 / vocab)
    drafts = torch.tensor([3, 9, 1, 2])
    for _ in range(20):
        emitted = rejection_sample(probs, argmax, [True, False], [2, 2], drafts)
        assert emitted[0] == [3, 4]
        assert 1 <= len(emitted[1]) <= 3
        assert emitted[1][: len(emitted[1]) - 1] == [1, 2][: len(emitted[1]) - 1]


def _chi_square(samples: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "a token outside the target's support"
    observed = observed[support]
    expected = probs[support].double()
    expected = expected / expected.sum() * observed.sum()
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("drafts_from", ["draft-model", "certain", "certain-seeded"])
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampled_requests_emit_the_target_distribution(drafts_from: str, top_p: float) -> None:
    """20,000 requests, two drafts each, against fixed target distributions p1, p2, p3 (the
    target here ignores context): the first emitted token follows p1, the second (when the
    first draft was kept) p2, the third p3. Seeded: each request its own seed (coupled
    verification)."""
    torch.manual_seed(0)
    vocab, num, k = 6, 20_000, 2
    logits = torch.tensor([[1.0, 0.3, -0.5, 0.8, -1.2, 0.1], [0.2, 1.1, 0.0, -0.7, 0.9, -2.0]])
    logits = torch.cat([logits, torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]])])
    meta = SamplingMetadata.build(
        [SamplingParams(temperature=1.0, top_p=top_p)] * 3,
        [[]] * 3,
        [[]] * 3,
        {},
        vocab,
        torch.device("cpu"),
    )
    target = filtered_probs(logits, meta)  # [3, vocab]: p1, p2, p3
    q = torch.tensor([[0.05, 0.05, 0.5, 0.1, 0.2, 0.1], [0.3, 0.1, 0.1, 0.1, 0.1, 0.3]])
    if drafts_from == "draft-model":
        draft_ids = torch.stack([torch.multinomial(q[j], num, replacement=True) for j in range(k)])
        draft_ids = draft_ids.T.reshape(-1)
        draft_probs = q.repeat(num, 1)
    else:  # certain drafts (as n-gram ones), half of them starting outside top-p's nucleus
        draft_ids = torch.tensor([2, 1, 0, 1]).repeat(num // 2)
        draft_probs = None
    keys = None
    if drafts_from == "certain-seeded":
        keys = {i: [position_seed(1000 + i, 40 + j) for j in range(k + 1)] for i in range(num)}
    emitted = rejection_sample(
        target.repeat(num, 1),
        logits.argmax(-1).repeat(num),
        [False] * num,
        [k] * num,
        draft_ids,
        draft_probs,
        keys,
    )
    for position in range(3):
        tokens = [e[position] for e in emitted if len(e) > position]
        assert len(tokens) > 500
        assert _chi_square(tokens, target[position]) > 1e-3, position


def test_seeded_requests_emit_their_own_samples_whatever_the_drafts() -> None:
    """A seeded request emits, at each position, what the sampler draws for it there (the key
    of that position): the drafts change only how many tokens a step emits."""
    vocab, num, k = 5, 8, 3
    torch.manual_seed(0)
    target = torch.softmax(torch.randn(num * (k + 1), vocab), -1)
    keys = {i: [position_seed(i, 7 + j) for j in range(k + 1)] for i in range(num)}
    own = keyed_exponential_race(target, [key for i in range(num) for key in keys[i]])
    own = own.view(num, k + 1).tolist()  # each request's samples at its k + 1 positions
    for drafts in (torch.randint(0, vocab, (num * k,)), torch.tensor(own)[:, :k].reshape(-1)):
        emitted = rejection_sample(
            target, target.argmax(-1), [False] * num, [k] * num, drafts, None, keys
        )
        for i, tokens in enumerate(emitted):
            assert tokens == own[i][: len(tokens)]
    assert all(len(tokens) == k + 1 for tokens in emitted)  # (drafts = the samples: all kept)
    one = rejection_sample(
        target[: k + 1],
        target[: k + 1].argmax(-1),
        [False],
        [k],
        torch.tensor(own[0][:k]),
        None,
        {0: keys[0]},
    )
    again = Sampler()(  # the sampler's own draw at the first position, as a plain step takes it
        torch.log(target[:1]),
        SamplingMetadata.build(
            [SamplingParams(temperature=1.0, seed=0)],
            [[]],
            [[]],
            {0: torch.Generator().manual_seed(keys[0][0])},
            vocab,
            torch.device("cpu"),
        ),
    )
    assert one[0][0] == own[0][0] == int(again.sampled_token_ids[0])


def test_speculative_config_parses_json_and_names_what_is_wrong() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.method, config.num_speculative_tokens, config.adaptive) == ("ngram", 4, True)
    draft = SpeculativeConfig.parse(
        {"method": "draft", "num_speculative_tokens": 3, "model": "smollm2", "adaptive": False}
    )
    assert (draft.model, draft.adaptive) == ("smollm2", False)
    assert SpeculativeConfig.parse({**config.__dict__, "model": None}) == config
    bad = {
        "{": "not valid JSON",
        "[1]": "must be a JSON object",
        '{"method": "ngram"}': "needs 'num_speculative_tokens'",
        '{"method": "eagle", "num_speculative_tokens": 2}': "must be one of",
        '{"method": "ngram", "num_speculative_tokens": 0}': "between 1 and 16",
        '{"method": "ngram", "num_speculative_tokens": true}': "must be int",
        '{"method": "ngram", "num_speculative_tokens": "4"}': "must be int",
        '{"method": "ngram", "num_speculative_tokens": null}': "must be int",
        '{"method": null, "num_speculative_tokens": 2}': "must be str",
        '{"method": "draft", "num_speculative_tokens": 2}': "needs a draft",
        '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}': "takes none",
        '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}': "unknown speculative",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}': "<=",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(text)


def test_adaptive_length_drafts_where_they_pay_and_not_elsewhere() -> None:
    # An 8B model on an H100, roughly: 4.8 ms of weights a step, 23 us of work a token.
    costs = StepCosts(fixed=4.8e-3, per_token=23e-6)
    assert choose_num_drafts(1, 0.8, 5, costs) == 5  # batch 1: drafts are nearly free
    assert 0 < choose_num_drafts(64, 0.8, 5, costs) < 5
    assert choose_num_drafts(256, 0.5, 5, costs) == 0  # the work per token dominates
    assert choose_num_drafts(1, 0.0, 5, costs) == 0  # nothing is ever accepted
    assert choose_num_drafts(0, 0.9, 5, costs) == 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0


def test_step_costs_and_acceptance_follow_what_they_observe() -> None:
    costs = StepCosts(fixed=1.0, per_token=1e-4)
    costs.observe(10, 0.0051)
    costs.observe(10, 0.0051)  # one size: the work per token stays, the fixed cost fits
    assert (costs.fixed, costs.per_token) == (pytest.approx(0.0051 - 1e-3), 1e-4)
    for n in (10, 40, 100, 400):
        costs.observe(n, 0.005 + 1e-5 * n)
    assert costs.fixed == pytest.approx(0.005, rel=1e-3)
    assert costs.per_token == pytest.approx(1e-5, rel=1e-3)
    windowed = StepCosts(fixed=1.0, per_token=1.0, window=4)
    for n in (10, 40, 100, 400):  # older steps, then four of a slower machine: only those count
        windowed.observe(n, 0.001 + 1e-6 * n)
    for n in (20, 50, 200, 300):
        windowed.observe(n, 0.008 + 3e-5 * n)
    assert windowed.fixed == pytest.approx(0.008, rel=1e-6)
    assert windowed.per_token == pytest.approx(3e-5, rel=1e-6)
    rate = Rate(prior=0.5, weight=0.5)
    rate.update(4, 4)
    assert rate.value == pytest.approx(0.75)
    rate.update(0, 0)  # a step without drafts says nothing
    assert rate.value == pytest.approx(0.75)


def test_draft_length_estimates_acceptance_per_position_and_counts_misses() -> None:
    """Acceptance a as coin flips until the first rejection: 3 kept and 1 rejection is a =
    0.75 (the share of drafts kept, 3 of 8, would say 0.375); when few requests get
    proposals, drafts stop paying."""
    costs = StepCosts(fixed=4.8e-3, per_token=23e-6)
    length = DraftLength(8, adaptive=True, costs=costs)
    length.acceptance.weight = length.proposal_rate.weight = 1.0
    length.observe(num_accepted=3, num_rejected=1)
    assert length.acceptance.value == pytest.approx(0.75)
    assert length.choose(64) > 0
    length.observe_proposals(num_decoding=64, num_drafted=1)
    assert length.proposal_rate.value == pytest.approx(1 / 64)
    assert length.choose(64) == 0  # one request in 64 gains: not worth a larger step
    assert choose_num_drafts(64, 0.75, 8, costs, proposal_rate=0.5) > 0
    fixed = DraftLength(3, adaptive=False, costs=costs)
    assert (fixed.choose(256), fixed.choose(0)) == (3, 0)


def test_draft_length_explores_after_steps_without_drafts_less_often_each_time() -> None:
    costs = StepCosts(fixed=1e-3, per_token=1e-3)  # (drafts never pay)
    length = DraftLength(4, adaptive=True, costs=costs)
    every, most = DraftLength.EXPLORE_EVERY, DraftLength.MAX_EXPLORE_EVERY
    choices = [length.choose(32) for _ in range(every + 2 * every + 4 * every)]
    assert set(choices) == {0, 1}
    tries = [i + 1 for i, k in enumerate(choices) if k]
    assert tries == [every, 3 * every, 7 * every]  # waits 64, 128, 256 steps
    choices = [length.choose(32) for _ in range(4 * most)]
    assert choices.count(1) in (3, 4)  # then once every MAX_EXPLORE_EVERY steps at most


def test_draft_length_weighs_what_drafted_steps_cost_beyond_their_tokens() -> None:
    """Steps with drafts that take twice what their size predicts (a draft model's forwards,
    no overlap) stop drafts that the plain step costs alone would take; plain steps slower than
    the prior do not make drafts look cheap."""
    length = DraftLength(4, adaptive=True, costs=StepCosts(fixed=5e-3, per_token=2e-5))
    length.acceptance.value = 0.5
    assert length.choose(8) == 4
    for _ in range(8):  # plain steps of 8 take 8 ms, not the prior's 5.16
        length.observe_cost(8, 8e-3, drafted=False)
    assert length.costs.seconds(8) == pytest.approx(8e-3)
    assert length.extra.seconds(40) == 0.0  # (no drafted step timed yet)
    assert length.choose(8) == 4
    for _ in range(8):
        length.observe_cost(40, 2 * length.costs.seconds(40), drafted=True)
    assert length.extra.seconds(40) == pytest.approx(length.costs.seconds(40))
    assert length.choose(8) == 0  # 1.9 tokens a step for twice the time
    length.acceptance.value = 0.95
    assert length.choose(8) == 4  # 4.5 tokens a step: worth it again
    fixed = DraftLength(4, adaptive=False, costs=StepCosts(fixed=5e-3, per_token=2e-5))
    fixed.observe_cost(40, 1.0, drafted=True)
    assert fixed.extra.fixed == 0.0  # not adaptive: nothing fitted


def test_drafts_stop_being_asked_for_when_no_proposal_comes_back() -> None:
    """Random prompts: prompt lookup never finds anything. The engine's steps take 8 ms (the
    prior says 5.3), each step drafts were asked for 1 ms more (no overlap): drafts are asked for
    in a handful of steps, then only in the ever rarer exploring ones."""
    length = DraftLength(4, adaptive=True, costs=StepCosts(fixed=4e-3, per_token=2e-5))
    asked = []
    for step in range(2000):
        k = length.choose(64)
        if k:
            asked.append(step)
            length.observe_proposals(num_decoding=64, num_drafted=0)
        length.observe_cost(64, 8e-3 + (1e-3 if k else 0.0), drafted=bool(k))
    assert len(asked) <= 12  # (2,000 steps)
    assert asked[-1] > 1000  # still exploring, ever more rarely


def test_requests_a_draft_model_still_catches_up_on_do_not_count_as_finding_no_drafts() -> None:
    """A proposal after a pause: the draft model feeds one request's backlog and drafts for it,
    the 63 others wait their turn. The share of requests that get drafts stays what it was
    (those 63 will get drafts), as prompt lookup's misses would not."""

    class CatchingUp(Proposer):
        def propose(
            self, requests: Sequence[Request], num_drafts: int
        ) -> dict[RequestId, list[int]]:
            self.num_deferred = len(requests) - 1
            return {requests[0].request_id: [7] * num_drafts}

        def forget(self, request_ids: Iterable[RequestId]) -> None:
            pass

    config = SpeculativeConfig(method="draft", num_speculative_tokens=4, model="m")
    speculator = Speculator(config, torch.nn.Linear(4, 4), torch.device("cpu"), CatchingUp())
    speculator.draft_length.proposal_rate.weight = 1.0
    running = []
    for i in range(64):
        request = Request(RequestId(f"r{i}"), [1, 2, 3], SamplingParams(max_tokens=8), None, 0.0)
        request.num_computed_tokens = request.num_tokens - 1  # (decoding)
        running.append(request)
    assert set(speculator.propose(running, 1)) == {"r0"}
    assert speculator.draft_length.proposal_rate.value == 1.0


def test_draft_length_does_not_learn_from_resumed_or_stalled_steps() -> None:
    """SmolLM2 at batch 1 as the H100 showed it: plain steps 1 ms, drafted steps 2.5 ms. The
    first drafted step after plain ones took 8 ms (its proposal caught up on the pause), and
    one took 400 ms (a kernel compiled): neither says what drafting costs step after step,
    and with them fitted, drafts that pay (acceptance 0.9: 4.1 tokens a step) would stop."""
    length = DraftLength(4, adaptive=True, costs=StepCosts(fixed=1e-3, per_token=1e-6))
    length.acceptance.value = 0.9
    for _ in range(8):
        length.observe_cost(1, 1e-3, drafted=False)
    length.observe_cost(5, 8e-3, drafted=True)  # resumed
    assert length.extra.seconds(5) == 0.0
    length.observe_cost(5, 2.5e-3, drafted=True)
    assert length.extra.seconds(5) == pytest.approx(1.5e-3, rel=0.01)
    length.observe_cost(5, 0.4, drafted=True)  # stalled
    length.observe_cost(1, 0.4, drafted=False)
    assert length.extra.seconds(5) == pytest.approx(1.5e-3, rel=0.01)
    assert length.costs.seconds(1) == pytest.approx(1e-3)
    assert length.choose(1) == 4


def test_drafted_steps_that_always_cost_ten_plain_ones_stop_drafts() -> None:
    """SmolLM2 drafting for itself at batch 64 as the H100 showed it: plain steps 2.7 ms, each
    step with drafts 40 to 47 ms (the draft model's forwards; over ten times what the plain fit
    predicts for its 320 tokens), every draft kept. Such steps are not stalls: after OUTLIER_RUN
    of them they are fitted, and drafts stop, though they are all kept."""
    length = DraftLength(4, adaptive=True, costs=StepCosts(fixed=2.5e-3, per_token=3e-6))
    length.acceptance.value = 1.0
    for _ in range(8):
        length.observe_cost(64, 2.7e-3, drafted=False)
    drafted = 0
    for step in range(64):
        k = length.choose(64)
        if not k:
            break
        drafted += 1
        assert length.costs.seconds(64 * (1 + k)) < 4e-3
        length.observe_cost(64 * (1 + k), 40e-3 + 7e-3 * (step % 2), drafted=True)
    assert drafted == DraftLength.OUTLIER_RUN + 1  # (the first, resumed, one of the run)
    assert length.choose(64) == 0


def _copying(speculator: Speculator, document: list[int], output: list[int]) -> list[int]:
    """One request whose prompt is `document` and that produces `output`, a token a step,
    without drafts unless the speculator asks for them; the draft counts it chose each step."""
    request = Request(RequestId("r"), document, SamplingParams(max_tokens=None), None, 0.0)
    chosen = []
    for token in output:
        request.append_output_token(token)
        request.num_computed_tokens = request.num_tokens - 1
        chosen.append(speculator.num_drafts(1))
        if not chosen[-1]:
            speculator.shadow([request])
    return chosen


def _shadowing_speculator() -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    speculator = Speculator(config, torch.nn.Linear(4, 4), torch.device("cpu"))
    length = speculator.draft_length
    # SmolLM2 at batch 1 on the H100: 1 ms a step, 1.5 ms more with drafts
    length.costs = StepCosts(fixed=1e-3, per_token=1e-6)
    length.extra = StepCosts(fixed=1.5e-3, per_token=0.0, signed=True)
    length.acceptance.value = length.proposal_rate.value = 0.05  # (after a stretch of misses)
    return speculator


def test_shadow_drafts_bring_drafts_back_when_the_text_turns_to_copying() -> None:
    """Drafts off after misses: beside the steps without drafts, the n-gram proposer guesses
    each next token (unverified) and the request's real tokens score the guesses: the request
    copies its prompt, so the guesses are right and drafts come back within a few steps, with
    no exploring step in between."""
    rng = random.Random(0)
    document = [rng.randrange(1000) for _ in range(80)]
    speculator = _shadowing_speculator()
    assert speculator.num_drafts(1) == 0
    chosen = _copying(speculator, document, document[:40])
    assert 0 < chosen.index(4) <= 25
    assert speculator.num_proposals == 0  # (shadow drafts are not proposals)
    assert speculator.draft_length.acceptance.value > 0.6


def test_shadow_drafts_keep_drafts_off_where_guesses_miss() -> None:
    """Random text: shadow guesses miss, drafts stay off, and nothing explores either (the
    n-gram proposer's acceptance is measured without verification)."""
    rng = random.Random(1)
    document = [rng.randrange(1000) for _ in range(80)]
    speculator = _shadowing_speculator()
    output = [rng.choice(document[:20]) for _ in range(400)]  # (n-grams recur, guesses miss)
    assert set(_copying(speculator, document, output)) == {0}
    assert speculator.draft_length.acceptance.value < 0.3


def test_proposers_that_cannot_shadow_are_explored_instead() -> None:
    class Costly(Proposer):
        def propose(
            self, requests: Sequence[Request], num_drafts: int
        ) -> dict[RequestId, list[int]]:
            raise AssertionError("asked beside a step without drafts")

        def forget(self, request_ids: Iterable[RequestId]) -> None:
            pass

    config = SpeculativeConfig(method="draft", num_speculative_tokens=4, model="m")
    speculator = Speculator(config, torch.nn.Linear(4, 4), torch.device("cpu"), Costly())
    speculator.draft_length.acceptance.value = 0.0
    request = Request(RequestId("r"), [1, 2, 3], SamplingParams(max_tokens=None), None, 0.0)
    request.append_output_token(4)
    chosen = []
    for _ in range(DraftLength.EXPLORE_EVERY):
        chosen.append(speculator.num_drafts(1))
        speculator.shadow([request])
    assert chosen[-1] == 1  # (an exploring step)
    assert set(chosen[:-1]) == {0}


@pytest.mark.parametrize("seed", range(20))
def test_greedy_drafts_judged_on_the_host_as_on_the_device(seed: int) -> None:
    """An all-greedy step's drafts are judged on the host from each row's argmax
    (`rejection.greedy_verdicts`): the same tokens as the device's verification."""
    from kvfleet.engine.sample.rejection import greedy_verdicts

    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (6,), generator=gen).tolist()
    logits = torch.randn(sum(counts) + len(counts), 4, generator=gen)
    argmax = logits.argmax(dim=-1)
    drafts = torch.randint(0, 4, (sum(counts),), generator=gen)
    greedy = [True] * len(counts)
    want = rejection_sample(logits.softmax(-1), argmax, greedy, counts, drafts)
    split = torch.split(drafts, counts)
    assert greedy_verdicts([d.tolist() for d in split], argmax.tolist()) == want
