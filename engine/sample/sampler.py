"""The one way into sampling: `sample(logits, batch)`, whatever path the step's plan chose
(sample/batch.py). The model runner calls nothing else here but the planner. What changes the
logits for every path (a logit bias, a grammar's token mask) belongs at the top of `sample`,
planned with the rest of the batch."""

from __future__ import annotations

import torch

from kvfleet.engine.sample.batch import ArgmaxBatch, DraftBatch, RaceBatch, SamplingBatch
from kvfleet.engine.sample.rejection import sample_with_drafts
from kvfleet.engine.sample.torch_sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_token_mask,
)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, token_mask: torch.Tensor | None = None
) -> SamplerOutput:
    """One step's tokens from its logits rows [rows, vocab] float32: the whole vocabulary's,
    or this rank's shard for a race (`needs_gathered_logits`). Queued on the device; nothing
    here waits for it. `token_mask`: the grammars' bitmask, a row per logits row
    (engine/structured/; its rows never race: `SamplingParams.needs_distribution`); logprobs
    stay the model's."""
    if token_mask is not None:
        assert not isinstance(batch, RaceBatch | ArgmaxBatch), (
            "a grammar's rows take the torch path"
        )
        if isinstance(batch, SamplingMetadata):
            return Sampler()(logits, batch, token_mask)
        apply_token_mask(logits, token_mask)
    if isinstance(batch, RaceBatch):
        from kvfleet.engine.sample.gumbel_race import race, winners

        columns = (batch.first_column, batch.num_columns)
        packed = race(logits, batch.temperature, batch.keys, batch.bases, *columns)
        if batch.reduce_max is not None:
            batch.reduce_max(packed)
        return SamplerOutput(winners(packed))
    if isinstance(batch, ArgmaxBatch):
        return SamplerOutput(logits.argmax(dim=-1))
    if isinstance(batch, DraftBatch):
        return sample_with_drafts(logits, batch.metadata, batch.drafts)
    return Sampler()(logits, batch)


def needs_gathered_logits(batch: SamplingBatch | None) -> bool:
    """Whether the step samples from the whole vocabulary's logits (all but the race, which
    each tensor-parallel rank runs over its own shard)."""
    return not isinstance(batch, RaceBatch)
