"""Speculative decoding in the real engine (SmolLM2 on the CPU, n-gram drafts).

Greedy output with drafts is token for token the output without them: prompts that quote a
document (most drafts kept), others (most rejected), max_tokens not a multiple of the draft
count, stop strings, stop token ids, and an end-of-sequence token kept in the middle of a step's
drafts. The same holds with chunked prefill, preemption and prefix-cache hits all in play, and
with the draft count changing from step to step (down to none, where steps overlap again).
Requests that opt out, ask for logprobs or use penalties get no drafts and the same output.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from scipy import stats as stats_module

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.draft_model import DraftModelProposer

from .conftest import MODEL, start_server, stop_server

DOC = (
    "Kubernetes schedules containers onto nodes. A Deployment keeps a set of identical pods "
    "running, replacing those that fail; a Service gives them one stable address."
)
PROMPTS = [
    f"Repeat the following text exactly.\n{DOC}\nRepeated text:\n",
    f"{DOC}\nQuote the first sentence of the text above:",
    "Count from one: 1, 2, 3, 4, 5, 6, 7,",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
# SmolLM2 drafting for itself, its weights then perturbed (so that it is sometimes wrong)
DRAFT = {"method": "draft", "model": MODEL, "num_speculative_tokens": 4, "adaptive": False}
METHODS = {"ngram": NGRAM, "draft": DRAFT}


def make(**extra: Any) -> LLM:
    options = {"num_blocks": 256, "max_model_len": 1024, **extra}
    llm = LLM(MODEL, dtype="float32", seed=0, **options)
    proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
    if isinstance(proposer, DraftModelProposer):
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for weight in proposer.runner.model.parameters():
                noise = torch.randn(weight.shape, generator=generator)
                weight.add_(noise.to(weight.dtype) * 0.1 * weight.std())
    return llm


@pytest.fixture(scope="module")
def plain() -> LLM:
    return make()


@pytest.fixture(scope="module", params=sorted(METHODS))
def speculative(request: pytest.FixtureRequest) -> LLM:
    return make(speculative_config=METHODS[request.param])


def cases(llm: LLM) -> list[tuple[Any, SamplingParams]]:
    """(prompt, params) pairs covering the ways a request ends."""
    tokenizer = llm.tokenizer
    eos = llm.engine.eos_token_id
    # A sentence that ends in EOS, repeated: the drafts after its start run through the EOS
    # and on into the next repetition, and the model keeps them all.
    sentence = tokenizer.encode("The cat sat on the mat today")
    looping = [*sentence, eos] * 4 + sentence[:3]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    return [
        *((p, greedy) for p in PROMPTS),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=13)),
        (PROMPTS[2], SamplingParams(temperature=0, max_tokens=17)),
        (PROMPTS[1], SamplingParams(temperature=0, max_tokens=64, stop=["blog post"])),
        (PROMPTS[2], SamplingParams(temperature=0, max_tokens=64, stop=[" 12,"])),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[30])),
        (looping, SamplingParams(temperature=0, max_tokens=30)),
    ]


def run(llm: LLM, pairs: list[tuple[Any, SamplingParams]]) -> list[tuple[Any, ...]]:
    prompts, params = zip(*pairs, strict=True)
    outputs = llm.generate(list(prompts), list(params))
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]


def test_greedy_output_with_drafts_is_the_output_without(plain: LLM, speculative: LLM) -> None:
    pairs = cases(plain)
    want = run(plain, pairs)
    stats = speculative.engine.scheduler.spec_decode_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    got = run(speculative, pairs)
    for (prompt, _), a, b in zip(pairs, want, got, strict=True):
        assert a == b, prompt
    drafted = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    assert 0 < accepted < drafted  # drafts kept and drafts rejected
    assert [r[2] for r in got[-6:]] == ["length", "length", "stop", "stop", "stop", "stop"]
    # the looping prompt stops at its EOS, which came in the middle of a step's drafts
    tokens, _, reason = got[-1]
    assert reason == "stop"
    assert len(tokens) < 30


def test_the_eos_is_kept_mid_draft(speculative: LLM) -> None:
    """One request alone: its step drafts past the EOS, keeps them all, and stops at the EOS."""
    llm = speculative
    prompt, params = cases(llm)[-1]
    stats = llm.engine.scheduler.spec_decode_stats
    before = stats.num_accepted_tokens
    config = llm.engine.config.speculative
    assert config is not None
    longer = make(speculative_config={**METHODS[config.method], "num_speculative_tokens": 7})
    (output,) = longer.generate([prompt], params)
    long_stats = longer.engine.scheduler.spec_decode_stats
    tokens = output.outputs[0].token_ids
    assert tokens[-1] == llm.engine.eos_token_id
    assert (long_stats.num_drafts, long_stats.num_accepted_tokens) == (1, 7)  # past the EOS
    assert len(tokens) < 7 + 1  # cut at the EOS
    (again,) = llm.generate([prompt], params)
    assert again.outputs[0].token_ids == tokens
    assert stats.num_accepted_tokens > before


@pytest.mark.parametrize("method", sorted(METHODS))
def test_chunked_prefill_preemption_and_prefix_hits_with_changing_draft_counts(
    plain: LLM, method: str
) -> None:
    """A small step budget (every prompt in chunks; the draft model catches up over several
    proposals), too few blocks for the batch (requests preempted and recomputed; the draft's
    cache as short), prompts sent twice (prefix-cache hits), and a draft count that goes 4, 0,
    2, 0, 0, 1 step after step (async overlap on and off)."""
    llm = make(
        num_blocks=24,
        max_model_len=256,
        max_num_batched_tokens=48,
        speculative_config=METHODS[method],
    )
    counts = itertools.cycle([4, 0, 2, 0, 0, 1])
    speculator = llm.engine.speculator
    assert speculator is not None
    speculator.num_drafts = lambda batch_size: next(counts)  # type: ignore[method-assign]
    pairs = [(p, SamplingParams(temperature=0, max_tokens=48)) for p in PROMPTS[:4] * 2]
    want = run(plain, pairs)
    got = run(llm, pairs)
    assert got == want
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.prefix_cache_hits > 0
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0


def test_requests_that_opt_out_or_need_every_token_get_no_drafts(
    plain: LLM, speculative: LLM
) -> None:
    stats = speculative.engine.scheduler.spec_decode_stats
    for params in (
        SamplingParams(temperature=0, max_tokens=24, speculative=False),
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
    ):
        before = stats.num_drafts
        (want,) = plain.generate([PROMPTS[0]], params)
        (got,) = speculative.generate([PROMPTS[0]], params)
        assert stats.num_drafts == before
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if params.logprobs:
            pairs = zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True)
            for a, b in pairs:
                assert a.top_token_ids == b.top_token_ids
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # beside drafted requests in the same steps
    mixed = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24),
    ]
    want = plain.generate([PROMPTS[0], PROMPTS[0]], mixed)
    got = speculative.generate([PROMPTS[0], PROMPTS[0]], mixed)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [t.token_id for t in got[0].outputs[0].logprobs] == got[0].outputs[0].token_ids


def test_seeded_sampling_with_drafts_is_sampling_without(plain: LLM, speculative: LLM) -> None:
    """A seeded request's tokens are those it gets without speculation, whatever the number
    of drafts per step (coupled verification: each position's own draw)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40)
    want = [o.outputs[0].token_ids for o in plain.generate([PROMPTS[0], PROMPTS[2]], params)]
    assert all(len(tokens) == 40 for tokens in want)
    engine = speculative.engine
    assert engine.speculator is not None
    length = engine.speculator.draft_length
    stats = engine.scheduler.spec_decode_stats
    accepted = stats.num_accepted_tokens
    try:
        for k in (4, 1, 3):
            length.max_drafts = k
            got = speculative.generate([PROMPTS[0], PROMPTS[2]], params)
            assert [o.outputs[0].token_ids for o in got] == want, k
    finally:
        length.max_drafts = 4
    assert stats.num_accepted_tokens > accepted


def test_server_speculates_counts_and_honours_the_opt_out(tmp_path: Path) -> None:
    """`kvfleet engine --speculative-config`, driven by the openai client: the same greedy
    text as the engine without drafts, the speculative counters on /metrics, and a request
    with `speculative: false` that adds no drafts."""
    # (a fixed draft count: whether adaptive drafts pay on a loaded 2-core CPU is timing)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    server = start_server(tmp_path, "--speculative-config", config)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        prompt = PROMPTS[0]
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        (want,) = make().generate([prompt], SamplingParams(temperature=0, max_tokens=40))
        assert reply.choices[0].text == want.outputs[0].text
        metrics = server.metrics()
        name = 'kvfleet:spec_decode_num_{}_total{{model_name="smollm2"}}'
        drafted = metrics[name.format("draft_tokens")]
        assert 0 < metrics[name.format("accepted_tokens")] <= drafted
        length = metrics['kvfleet:spec_decode_mean_acceptance_length{model_name="smollm2"}']
        assert 1.0 < length <= 4.0
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            extra_body={"speculative": False},
        )
        assert server.metrics()[name.format("draft_tokens")] == drafted
        with pytest.raises(openai.BadRequestError, match="speculative"):
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=4, extra_body={"speculative": "maybe"}
            )
    finally:
        stop_server(server)


def test_two_ranks_verify_drafts_as_one_does(plain: LLM) -> None:
    """Tensor parallelism (gloo): rank 0 proposes and verifies; the workers run the same
    forward over the drafts."""
    llm = make(speculative_config=NGRAM, tensor_parallel_size=2)
    try:
        pairs = [(p, SamplingParams(temperature=0, max_tokens=32)) for p in PROMPTS[:3]]
        assert run(llm, pairs) == run(plain, pairs)
        assert llm.engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize(("method", "top_p"), [("ngram", 1.0), ("ngram", 0.8), ("draft", 0.8)])
def test_sampling_with_drafts_keeps_the_models_distribution(
    tiny_config: Callable[..., Path], method: str, top_p: float
) -> None:
    """A random model over 6 tokens, 3 tokens sampled at temperature 1 by 12,000 requests with
    drafts (n-gram, or a draft model's greedy tokens): the second token verified against a draft,
    the third the bonus or sampled next step. The joint distribution of the 3 tokens is the
    model's, computed exactly from its logprobs (chi-square), and tokens outside the top-p
    nucleus never appear."""
    path = tiny_config(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    speculative: dict[str, Any] = {**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    if method == "draft":  # (the same random weights: it drafts the target's argmax)
        speculative = {**DRAFT, "model": str(path), "num_speculative_tokens": 2}
    # (room for 256 new requests' prompts in a step: the draft catches up on them at once)
    llm = LLM(
        str(path),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        num_blocks=2048,
        max_model_len=64,
        max_num_batched_tokens=8192,
        speculative_config=speculative,
    )
    llm.engine.runner.model.lm_head.weight.data.mul_(15)  # (peaked distributions)
    once = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    # The prompt: the model's own greedy text, so that drafts copied from it are often kept.
    prompt = [0, 1, 2, 3, 4, 5]
    prompt += llm.generate([prompt], once)[0].outputs[0].token_ids

    def target(context: list[int]) -> np.ndarray:
        """The distribution after `context`: from all 6 logprobs, then the top-p nucleus."""
        exact = SamplingParams(temperature=0, max_tokens=1, logprobs=6, ignore_eos=True)
        (top,) = llm.generate([context], exact)[0].outputs[0].logprobs
        probs = np.zeros(6)
        probs[top.top_token_ids] = np.exp(top.top_logprobs)
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        probs[order[mass_before >= top_p]] = 0.0
        return probs / probs.sum()

    joint = np.zeros((6, 6, 6))
    first = target(prompt)
    for a in np.flatnonzero(first):
        second = target([*prompt, int(a)])
        for b in np.flatnonzero(second):
            joint[a, b] = first[a] * second[b] * target([*prompt, int(a), int(b)])

    stats = llm.engine.scheduler.spec_decode_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    samples = 12_000
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True)
    counts = np.zeros((6, 6, 6))
    for output in llm.generate([prompt] * samples, params):
        counts[tuple(output.outputs[0].token_ids)] += 1
    drafted = stats.num_draft_tokens - before[0]
    accepted = stats.num_accepted_tokens - before[1]
    assert drafted >= samples  # every request verified a draft for its second token
    assert 0.05 * drafted < accepted < 0.95 * drafted  # kept often, rejected often

    assert counts[joint == 0].sum() == 0  # (outside the nucleus)
    expected = (joint * samples).ravel()
    observed = counts.ravel()
    rare = (expected > 0) & (expected < 5)  # pooled into one cell
    keep = expected >= 5
    f_obs, f_exp = observed[keep], expected[keep]
    if rare.any():
        f_obs = np.append(f_obs, observed[rare].sum())
        f_exp = np.append(f_exp, expected[rare].sum())
    assert stats_module.chisquare(f_obs, f_exp).pvalue > 1e-3


@pytest.mark.parametrize(
    "family",
    ["qwen3-moe-dense-layer", "mixtral-moe", "gemma2-softcap-windows", "gemma3-local-global",
     "phi3-longrope"],
)  # fmt: skip
def test_new_families_keep_their_greedy_output_with_drafts(
    family: str, hf_model_dir: Callable[[str], tuple[Any, Path]]
) -> None:
    """The families beyond Llama under n-gram drafts and under a draft model (the same small
    model drafting for itself): greedy output token for token the output without drafts (and
    drafts kept), chunked prompts, repeated text beside random text."""
    _, folder = hf_model_dir(family)
    generator = torch.Generator().manual_seed(5)
    loop = torch.randint(3, 384, (9,), generator=generator).tolist()
    prompts = [loop * 6, torch.randint(3, 384, (40,), generator=generator).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for speculative in (None, NGRAM, {**DRAFT, "model": str(folder)}):
        llm = LLM(
            str(folder),
            dtype="float32",
            skip_tokenizer_init=True,
            num_blocks=128,
            max_model_len=256,
            max_num_batched_tokens=32,
            speculative_config=speculative,
        )
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if speculative is not None:
            assert llm.engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    assert outputs[0] == outputs[1] == outputs[2]
