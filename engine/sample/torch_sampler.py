"""The batched sampler: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One pass over the whole batch's logits on the device. The only per-request Python work is for
requests with their own seed, whose draws are keyed by (seed, position) (`position_seed`; on
CUDA the vocabulary race's noise, as plain steps race): the same tokens whatever the batch, a
preemption, the scheduling or the drafts verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfleet.engine.layers.host_copy import column as host_column
from kvfleet.engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """The batch's sampling knobs as device tensors, one row per sampled request."""

    temperature: torch.Tensor  # [B] float32, 0 in greedy rows
    greedy: torch.Tensor  # [B] bool: temperature == 0 (derived on the device)
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # [B, max_output] int64, padded with vocab_size
    generators: dict[int, torch.Generator]  # row -> the request's own generator
    max_num_logprobs: int | None  # None: no row asked for logprobs
    # (rows [n] int64, token ids [n] int64, biases [n] float32) over every row's logit_bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return host_column(values, dtype, device)

        temperature = column([p.effective_temperature for p in params])
        has_penalties = any(p.has_penalties for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy=temperature == 0,
            all_greedy=all(p.is_greedy for p in params),
            top_k=column([p.top_k or vocab_size for p in params], torch.int64)
            if any(p.top_k is not None for p in params)
            else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            presence_penalty=column([p.presence_penalty for p in params])
            if has_penalties
            else None,
            frequency_penalty=column([p.frequency_penalty for p in params])
            if has_penalties
            else None,
            repetition_penalty=column([p.repetition_penalty for p in params])
            if has_penalties
            else None,
            prompt_token_ids=_pad(prompt_token_ids, vocab_size, device) if has_penalties else None,
            output_token_ids=_pad(output_token_ids, vocab_size, device) if has_penalties else None,
            generators=generators,
            max_num_logprobs=max(logprobs) if logprobs else None,
            logit_bias=_logit_bias(params, device),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # With logprobs: [B, 1 + k] ids and logprobs (the sampled token first), and ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    # Speculative steps: per request, the drafts it kept (its tokens are those, then
    # sampled_token_ids' entry).
    num_accepted: torch.Tensor | None = None


class Sampler:
    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, token_mask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits [B, vocab] float32 -> one token per row; `token_mask`: the grammars' bitmask
        (engine/structured/), applied after the logprobs are taken and the bias added."""
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = apply_logit_bias(logits, meta)
        if token_mask is not None:
            apply_token_mask(logits, token_mask)
        if meta.presence_penalty is not None:
            logits = apply_penalties(logits, meta)
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy_tokens
        else:
            probs = filtered_probs(logits, meta)
            sampled = torch.where(
                meta.greedy, greedy_tokens, exponential_race(probs, meta.generators)
            )
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits (a new tensor; logprobs stay the model's)."""
    if meta.logit_bias is None:
        return logits
    rows, token_ids, biases = meta.logit_bias
    return logits.index_put((rows, token_ids), biases, accumulate=True)


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Tokens a grammar forbids (a 0 bit in the row's int32 bitmask, engine/structured/) to
    -inf, in place, by xgrammar's kernel."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def _logit_bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries, strict=True)
    return (
        host_column(rows, torch.int64, device),
        host_column(token_ids, torch.int64, device),
        host_column(biases, torch.float32, device),
    )


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition over prompt and output tokens (divide positive logits,
    multiply negative ones); frequency by output count; presence by output occurrence."""
    assert meta.output_token_ids is not None
    assert meta.prompt_token_ids is not None
    assert meta.frequency_penalty is not None
    assert meta.repetition_penalty is not None
    num_rows, vocab_size = logits.shape
    # One extra column absorbs the padding id (vocab_size).
    output_counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    output_counts.scatter_add_(
        1, meta.output_token_ids, torch.ones_like(meta.output_token_ids, dtype=torch.float32)
    )
    output_counts = output_counts[:, :vocab_size]
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, meta.prompt_token_ids, True)
    seen = seen[:, :vocab_size] | (output_counts > 0)
    repetition = meta.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalty[:, None] * output_counts
    return logits - meta.presence_penalty[:, None] * (output_counts > 0)  # type: ignore[index]


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p filtering."""
    # (greedy rows, temperature 0, take their argmax elsewhere: any finite divisor serves)
    logits = logits / meta.temperature.masked_fill(meta.greedy, 1.0)[:, None]
    if meta.top_k is not None or meta.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if meta.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
            drop |= ranks >= meta.top_k[:, None]
        if meta.top_p is not None:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= meta.top_p[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for the token at `position`."""
    return (seed * 0x9E3779B97F4A7C15 + position) % (1 << 63)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample each row of `probs` as argmax(p / E) with E ~ Exp(1): one draw per vocab entry;
    rows with their own generator (seeded, its seed the position's key) take that key's draw
    (`keyed_exponential_race`: reproducible whatever the batch)."""
    noise = torch.empty_like(probs).exponential_()
    sampled = (probs / noise).argmax(dim=-1)
    if generators:
        rows = torch.tensor(list(generators), dtype=torch.int64, device=probs.device)
        keys = [generator.initial_seed() for generator in generators.values()]
        sampled[rows] = keyed_exponential_race(probs[rows], keys)
    return sampled


def keyed_exponential_race(probs: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """Sample row i of `probs` with the draw of key keys[i] (`position_seed`), the same on every
    path a step may take. On CUDA that is the vocabulary race's keyed noise
    (sample/gumbel_race.py) over log p: where a plain step races the logits instead (no row of its
    batch needs the distribution), the same token. Elsewhere: argmax(p / E), E drawn by a
    generator seeded with the key."""
    if _draws_by_race(probs.device):
        from kvfleet.engine.sample.gumbel_race import race, winners

        n, device = len(keys), probs.device
        packed = race(
            probs.log().float().contiguous(),
            torch.ones(n, dtype=torch.float64, device=device),
            torch.tensor(list(keys), dtype=torch.int64, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )
        return winners(packed)
    generator = torch.Generator(device=probs.device)
    noise = torch.empty_like(probs)
    for row, key in enumerate(keys):
        generator.manual_seed(key)
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _draws_by_race(device: torch.device) -> bool:
    """Whether keyed draws come from the vocabulary race (where plain steps race: CUDA)."""
    return device.type == "cuda"


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    sampled_logprob = raw_logprobs.gather(1, sampled[:, None])
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = (
        raw_logprobs.topk(k, dim=-1) if k else (raw_logprobs[:, :0], sampled[:, None][:, :0])
    )
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        sampled_ranks=ranks,
    )


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return host_column(padded, torch.int64, device)
