"""A step's sampling, planned once on the host from the requests it samples: which path draws
the tokens, and the tensors that path reads. `sample(logits, batch)` (sample/sampler.py) runs it.

The paths, one per step:
- `RaceBatch`: the vocabulary race (gumbel_race.py; on CUDA), when no row needs the whole
  distribution (no top-k/p, min-p, penalties or logprobs). Its rows ride in the step message
  (every tensor-parallel rank races its own vocabulary shard), so `plan` returns them as host
  arrays to pack and `RaceBatch` is made from the packed step's device views.
- `ArgmaxBatch`: a speculative step whose requests all decode greedily with nothing to apply
  or return (`SamplingParams.is_plain_greedy`): each row's argmax comes back and the drafts are
  judged on the host.
- `DraftBatch`: other speculative steps: rejection sampling (rejection.py).
- `SamplingMetadata`: the torch sampler (torch_sampler.py).

Greedy is one encoding throughout: a temperature of 0 (`SamplingParams.effective_temperature`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvfleet.engine.layers.host_copy import to_device
from kvfleet.engine.sample.rejection import StepDrafts
from kvfleet.engine.sample.torch_sampler import SamplingMetadata, position_seed
from kvfleet.engine.sampling_params import SamplingParams


class SampledRequest(Protocol):
    """What planning reads of a request the step samples (the runner's cached state)."""

    @property
    def req_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def generator(self) -> torch.Generator | None: ...


@dataclass(frozen=True)
class RaceBatch:
    """Per sampled row: the race's Philox key, the offset of vocabulary index 0 in the key's
    stream, and the temperature (0: argmax); the vocabulary columns this rank holds."""

    keys: torch.Tensor  # [rows] int64
    bases: torch.Tensor  # [rows] int64
    temperature: torch.Tensor  # [rows] float64
    first_column: int
    num_columns: int
    # With tensor parallelism: the all-reduce MAX that picks the winner over the ranks' shards.
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class ArgmaxBatch:
    """Every row's argmax (the drafts of an all-greedy speculative step are judged on the host,
    `rejection.greedy_verdicts`)."""


@dataclass(frozen=True)
class DraftBatch:
    """A speculative step: `metadata` has one row per logits row (k + 1 per request with k
    drafts)."""

    metadata: SamplingMetadata
    drafts: StepDrafts


SamplingBatch = RaceBatch | ArgmaxBatch | DraftBatch | SamplingMetadata


@dataclass(frozen=True)
class RaceRows:
    """A race step's rows on the host, to pack into the step message: keys, bases and the
    temperatures as float64 bits (int64)."""

    arrays: list[np.ndarray]


# Per batch (its request ids), its temperatures and seeded rows' seeds, or None where a row
# needs the whole distribution.
_RaceCache = tuple[tuple[str, ...], tuple[np.ndarray, dict[int, int]] | None]


class SamplingPlanner:
    """Plans each step's sampling for one runner. The last step's tensors are reused while the
    same requests are sampled in the same order (steady decoding) and nothing read from their
    outputs changes (penalties)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.race = device.type == "cuda"  # the vocabulary race needs Triton on CUDA
        self._last: tuple[tuple[str, ...], SamplingMetadata] | None = None
        self._last_race: _RaceCache | None = None
        self._step_keys = np.random.default_rng(torch.initial_seed())

    def forget(self) -> None:
        """Build anew next step (a request came or went: an id may return with other
        parameters)."""
        self._last = self._last_race = None

    def plan(
        self,
        requests: Sequence[SampledRequest],
        positions: Sequence[int],
        drafts: list[list[int]] | None = None,
    ) -> RaceRows | SamplingBatch:
        """The step's sampling. `positions`: per request, the position of the (first) token it
        samples; `drafts`: per request, the drafts it verifies (a speculative step)."""
        if drafts is not None:
            if all(r.sampling_params.is_plain_greedy for r in requests):
                return ArgmaxBatch()
            return self._draft_batch(requests, drafts, positions)
        race = self._race_rows(requests, positions)
        if race is not None:
            return race
        meta = self._metadata(requests)
        for row, generator in meta.generators.items():
            seed = requests[row].sampling_params.seed
            assert seed is not None  # (only seeded requests have a generator)
            generator.manual_seed(position_seed(seed, positions[row]))
        return meta

    def _race_rows(
        self, requests: Sequence[SampledRequest], positions: Sequence[int]
    ) -> RaceRows | None:
        if not self.race or not requests:
            return None
        key = tuple(r.req_id for r in requests)
        if self._last_race is None or self._last_race[0] != key:
            params = [r.sampling_params for r in requests]
            if any(p.needs_distribution for p in params):
                self._last_race = (key, None)
            else:
                temperatures = np.array([p.effective_temperature for p in params], np.float64)
                seeds = {row: p.seed for row, p in enumerate(params) if p.seed is not None}
                self._last_race = (key, (temperatures, seeds))
        rows = self._last_race[1]
        if rows is None:
            return None
        temperature, seeds = rows
        # Unseeded rows: the step's key, each row its own stretch of the stream.
        keys = np.full(len(requests), self._step_keys.integers(1 << 62), np.int64)
        bases = np.arange(len(requests), dtype=np.int64) * self.vocab_size
        for row, seed in seeds.items():
            keys[row], bases[row] = position_seed(seed, int(positions[row])), 0
        return RaceRows([keys, bases, temperature.view(np.int64)])

    def _metadata(self, requests: Sequence[SampledRequest]) -> SamplingMetadata:
        key = tuple(r.req_id for r in requests)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in requests],
            [r.token_ids[: r.num_prompt_tokens] for r in requests],
            [r.token_ids[r.num_prompt_tokens :] for r in requests],
            {i: r.generator for i, r in enumerate(requests) if r.generator is not None},
            self.vocab_size,
            self.device,
        )
        self._last = None if meta.presence_penalty is not None else (key, meta)
        return meta

    def _draft_batch(
        self,
        requests: Sequence[SampledRequest],
        drafts: list[list[int]],
        positions: Sequence[int],
    ) -> DraftBatch:
        counts = [len(d) + 1 for d in drafts]
        rows = [r for r, count in zip(requests, counts, strict=True) for _ in range(count)]
        # (penalties read the outputs: requests with them carry no drafts)
        penalized = any(r.sampling_params.has_penalties for r in requests)
        meta = SamplingMetadata.build(
            [r.sampling_params for r in rows],
            [r.token_ids[: r.num_prompt_tokens] if penalized else [] for r in rows],
            [r.token_ids[r.num_prompt_tokens :] if penalized else [] for r in rows],
            {},
            self.vocab_size,
            self.device,
        )
        step_drafts = StepDrafts(
            num_drafts=[count - 1 for count in counts],
            token_ids=to_device(np.array([t for d in drafts for t in d], np.int64), self.device),
            greedy=[r.sampling_params.is_greedy for r in requests],
            keys={
                i: [position_seed(seed, positions[i] + j) for j in range(count)]
                for i, (r, count) in enumerate(zip(requests, counts, strict=True))
                if (seed := r.sampling_params.seed) is not None and not r.sampling_params.is_greedy
            },
        )
        return DraftBatch(meta, step_drafts)
