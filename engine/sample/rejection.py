"""Verification of draft tokens by rejection sampling: the emitted tokens follow the target
model's distribution exactly, whatever the drafts.

Per request with drafts d_1..d_k, drafted from distributions q_1..q_k (a point mass for the
n-gram proposer), and the target's distributions p_1..p_{k+1} after each input position: d_j is
accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the request
emits a token drawn from the residual max(0, p_j - q_j) (normalized) and stops; when every
draft is accepted it emits a bonus token drawn from p_{k+1}. So each step emits between 1 and
k + 1 tokens, each distributed as sampling from p would have been (Leviathan et al. 2023;
Chen et al. 2023). Greedy requests accept a draft iff it is the target's argmax and emit the
argmax at the first mismatch: the same tokens as decoding without drafts.

Seeded requests verify by coupling instead: each of their rows is sampled with the draw the
sampler makes for that position (`keyed_exponential_race`), and drafts are kept while they equal
those samples. With certain drafts (both proposers draft greedily) that is the same rejection
sampling (a draft is kept with probability p(d), and at a rejection the sample follows p without
d, the residual), but what a seeded request emits then depends on neither the drafts nor how
many there were: the tokens it would have had without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfleet.engine.sample.torch_sampler import (
    SamplerOutput,
    SamplingMetadata,
    apply_logit_bias,
    apply_penalties,
    exponential_race,
    filtered_probs,
    gather_logprobs,
    keyed_exponential_race,
)


@dataclass(frozen=True)
class StepDrafts:
    """A step's drafts, per sampled request in row order: how many (its logits rows are that
    many plus one), whether it samples greedily, and for seeded ones the keys of their rows'
    draws."""

    num_drafts: list[int]
    token_ids: torch.Tensor  # [sum(num_drafts)] int64, request after request
    greedy: list[bool]
    keys: dict[int, list[int]]  # seeded request index -> position_seed of each of its rows


def sample_with_drafts(
    logits: torch.Tensor, meta: SamplingMetadata, drafts: StepDrafts
) -> SamplerOutput:
    """The sampler's work for a step whose requests have num_drafts + 1 logits rows each
    (`meta` per row): penalties, argmax, filtered distributions, then the verdicts. A request
    without drafts samples exactly as `Sampler` would (the same draw from the same generator);
    logprobs, asked only by requests without drafts, are those of each request's last row."""
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    logits = apply_logit_bias(logits, meta)
    if meta.presence_penalty is not None:
        logits = apply_penalties(logits, meta)
    argmax = logits.argmax(dim=-1)
    probs = logits if meta.all_greedy else filtered_probs(logits, meta)
    num_accepted, last = verify_drafts(
        probs,
        argmax,
        drafts.greedy,
        drafts.num_drafts,
        drafts.token_ids,
        keys=drafts.keys,
    )
    if raw_logprobs is None:
        return SamplerOutput(last, num_accepted=num_accepted)
    rows = torch.tensor(drafts.num_drafts, device=logits.device).add_(1).cumsum_(0).sub_(1)
    result = gather_logprobs(raw_logprobs[rows], last, meta.max_num_logprobs or 0)
    result.num_accepted = num_accepted
    return result


def verify_drafts(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    greedy: Sequence[bool],
    num_drafts: Sequence[int],
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    keys: dict[int, list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, how many of its drafts it keeps and the token after them (the rejected
    draft's replacement, or the bonus), both [num_requests] int64 on the device, queued
    without waiting. Rows of `target_probs` [sum(k_i + 1), vocab] (each a distribution after
    temperature and top-k/p/min-p; any values in greedy requests' rows) and `target_argmax`
    [same rows] (of the logits) come in request order, k_i + 1 per request; `draft_token_ids`
    [sum k_i] likewise k_i per request, and `draft_probs` [sum k_i, vocab] the distributions
    they were drawn from (None: each draft was certain, q(d) = 1). `keys`: sampled (not greedy)
    seeded request index -> the key of each of its k_i + 1 rows' draws (coupled verification;
    their drafts must be certain)."""
    device = target_probs.device
    counts = torch.tensor(num_drafts, dtype=torch.int64, device=device)
    num_reqs = len(num_drafts)
    # Each draft's request and the target row that judges it (row t of its request).
    draft_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), counts, output_size=sum(num_drafts)
    )  # (its size given: no wait for the device)
    first_row = torch.cumsum(counts + 1, 0) - (counts + 1)
    first_draft = torch.cumsum(counts, 0) - counts
    within = torch.arange(draft_token_ids.numel(), device=device) - first_draft[draft_req]
    judge_row = first_row[draft_req] + within
    last_row = first_row + counts

    greedy_req = torch.tensor(list(greedy), dtype=torch.bool, device=device)
    argmax_judged = target_argmax[judge_row]
    if all(greedy):  # (no draws, no residuals)
        accept = draft_token_ids == argmax_judged
        recovered, bonus = argmax_judged, target_argmax[last_row]
    else:
        accept, recovered, bonus = _sampled_verdicts(
            target_probs,
            greedy_req,
            draft_req,
            judge_row,
            last_row,
            argmax_judged,
            target_argmax,
            draft_token_ids,
            draft_probs,
        )
        if keys:
            accept, recovered, bonus = _coupled_verdicts(
                target_probs,
                num_drafts,
                keys,
                draft_req,
                judge_row,
                last_row,
                draft_token_ids,
                (accept, recovered, bonus),
            )
    # Each request keeps its leading accepted drafts, then one token: the rejected draft's
    # replacement, or the bonus when all were kept.
    table = torch.zeros(num_reqs, max(num_drafts, default=0) + 1, dtype=torch.int64, device=device)
    table[draft_req, within] = accept.long()
    num_accepted = table.cumprod(1).sum(1)
    last = bonus
    if draft_token_ids.numel():
        replaced = recovered[(first_draft + num_accepted).clamp(max=draft_token_ids.numel() - 1)]
        last = torch.where(num_accepted < counts, replaced, bonus)
    return num_accepted, last


def emitted_tokens(
    draft_token_ids: Sequence[int],
    num_drafts: Sequence[int],
    num_accepted: Sequence[int],
    last: Sequence[int],
) -> list[list[int]]:
    """Per request, its kept drafts and the token after them (from `verify_drafts`)."""
    emitted = []
    begin = 0
    for k, a, tail in zip(num_drafts, num_accepted, last, strict=True):
        emitted.append([*draft_token_ids[begin : begin + a], tail])
        begin += k
    return emitted


def _sampled_verdicts(
    target_probs: torch.Tensor,
    greedy_req: torch.Tensor,
    draft_req: torch.Tensor,
    judge_row: torch.Tensor,
    last_row: torch.Tensor,
    argmax_judged: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per draft, whether it is kept and what replaces it when it is not (from the residual
    max(0, p - q)); per request, the bonus token (from its last row). Greedy rows: argmax."""
    device = target_probs.device
    draft_greedy = greedy_req[draft_req]
    p_draft = target_probs[judge_row, draft_token_ids]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1)
    uniform = torch.rand(p_draft.shape, device=device)
    accept = torch.where(
        draft_greedy, draft_token_ids == argmax_judged, uniform * q_draft < p_draft
    )
    judged = target_probs[judge_row]
    if draft_probs is None:
        residual = judged.scatter(1, draft_token_ids[:, None], 0.0)
    else:
        residual = (judged - draft_probs).clamp_(min=0.0)
    recovered = torch.where(draft_greedy, argmax_judged, exponential_race(residual, {}))
    bonus = torch.where(
        greedy_req, target_argmax[last_row], exponential_race(target_probs[last_row], {})
    )
    return accept, recovered, bonus


def _coupled_verdicts(
    target_probs: torch.Tensor,
    num_drafts: Sequence[int],
    keys: dict[int, list[int]],
    draft_req: torch.Tensor,
    judge_row: torch.Tensor,
    last_row: torch.Tensor,
    draft_token_ids: torch.Tensor,
    verdicts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verdicts` (accept, recovered, bonus) with the seeded requests' replaced: each of their
    rows sampled by its key, drafts kept while equal to those samples."""
    device = target_probs.device
    first_rows = [0]
    for count in num_drafts:
        first_rows.append(first_rows[-1] + count + 1)
    rows = [first_rows[req] + j for req, row_keys in keys.items() for j in range(len(row_keys))]
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    sampled = torch.full((first_rows[-1],), -1, dtype=torch.int64, device=device)
    sampled[index] = keyed_exponential_race(
        target_probs[index], [key for row_keys in keys.values() for key in row_keys]
    )
    seeded = torch.zeros(len(num_drafts), dtype=torch.bool)
    seeded[list(keys)] = True
    seeded = seeded.to(device)
    seeded_draft = seeded[draft_req]
    accept, recovered, bonus = verdicts
    judged = sampled[judge_row]
    accept = torch.where(seeded_draft, draft_token_ids == judged, accept)
    recovered = torch.where(seeded_draft, judged, recovered)
    bonus = torch.where(seeded, sampled[last_row], bonus)
    return accept, recovered, bonus


def greedy_verdicts(drafts: list[list[int]], argmax: list[int]) -> list[list[int]]:
    """Greedy verification: each request's drafts (k of them, its k + 1 logits rows' `argmax`
    in order) kept while they equal the argmax before them, then the argmax after the last
    kept one (the replacement of the first mismatch, or the bonus)."""
    tokens = []
    row = 0
    for draft in drafts:
        kept = 0
        while kept < len(draft) and draft[kept] == argmax[row + kept]:
            kept += 1
        tokens.append([*draft[:kept], argmax[row + kept]])
        row += len(draft) + 1
    return tokens
