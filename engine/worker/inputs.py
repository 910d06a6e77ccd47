"""The model runner's inputs: the state it keeps per request (token ids, block table,
generator), updated from the scheduler's diffs, and one step flattened into varlen tensors
(`prepare_inputs`): ids, positions, slots, block tables and the sampled rows, packed in the two
buffers the step message carries (parallel/step_message.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfleet.engine.core.block_pool import NULL_BLOCK_ID
from kvfleet.engine.core.request import RequestId
from kvfleet.engine.core.scheduler_output import SchedulerOutput
from kvfleet.engine.layers.host_copy import to_device
from kvfleet.engine.lora.manager import LoRAManager
from kvfleet.engine.lora.ops import LoRABatch
from kvfleet.engine.parallel.step_message import PackedStep, StepInputs, pack_aligned
from kvfleet.engine.sample.batch import ArgmaxBatch, RaceRows, SamplingBatch, SamplingPlanner
from kvfleet.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: RequestId
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_computed_tokens: int
    generator: torch.Generator | None
    lora_name: str | None = None
    # The request's block ids in the first num_blocks entries (grown by doubling).
    block_table: np.ndarray = field(default_factory=lambda: np.zeros(16, np.int64))
    num_blocks: int = 0

    def add_blocks(self, block_ids: Sequence[int]) -> None:
        end = self.num_blocks + len(block_ids)
        if end > len(self.block_table):
            grown = np.zeros(max(end, 2 * len(self.block_table)), np.int64)
            grown[: self.num_blocks] = self.block_table[: self.num_blocks]
            self.block_table = grown
        self.block_table[self.num_blocks : end] = block_ids
        self.num_blocks = end


@dataclass(frozen=True)
class InFlight:
    """The step still on the device: the row of each request it samples, and its sampled
    tokens (on the device), some of which are inputs of the next step."""

    row_of: dict[RequestId, int]
    sampled_token_ids: torch.Tensor


@dataclass(frozen=True)
class ModelInputs:
    step: StepInputs  # views into `packed`: ids, positions, attention metadata, sampled rows
    sampled_req_ids: list[RequestId]
    # per sampled request, the position of the token it samples (the first, with drafts)
    sampled_positions: list[int]
    packed: PackedStep  # the same inputs as two flat buffers (what tensor parallelism sends)
    lora: LoRABatch | None = None  # None: no token of the step uses an adapter
    # Speculative steps: per sampled request, the drafts it verifies (else None)
    drafts: list[list[int]] | None = None
    # How the step samples (a race's rows are packed in `packed`)
    sampling: RaceRows | SamplingBatch = field(default_factory=ArgmaxBatch)


def update_states(
    out: SchedulerOutput,
    requests: dict[RequestId, CachedRequestState],
    sampling: SamplingPlanner,
    device: torch.device,
) -> None:
    """Apply the scheduler's diff to the cached request states."""
    if out.finished_req_ids or out.scheduled_new_reqs:
        sampling.forget()  # (an id may come back with other parameters)
    for req_id in out.finished_req_ids:
        requests.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)  # seeded before each draw
        state = CachedRequestState(
            new.req_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            params,
            new.num_computed_tokens,
            generator,
            new.lora_name,
        )
        state.add_blocks(new.block_ids)
        requests[new.req_id] = state
    for cached in out.scheduled_cached_reqs:
        state = requests[cached.req_id]
        if cached.new_block_ids:
            state.add_blocks(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens


def prepare_inputs(
    out: SchedulerOutput,
    requests: dict[RequestId, CachedRequestState],
    block_size: int,
    device: torch.device,
    sampling: SamplingPlanner,
    in_flight: InFlight | None,
    lora: LoRAManager | None,
) -> ModelInputs:
    """Flatten the step: per-token arrays built with numpy, sent in two copies."""
    bs = block_size
    states = [requests[req_id] for req_id in out.num_scheduled_tokens]
    num_tokens = np.fromiter(out.num_scheduled_tokens.values(), np.int64, len(states))
    starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
    ends = starts + num_tokens
    # One-token rows (decodes) first, for the decode kernel (the rest take the varlen one);
    # within each, longest sequences first: attention programs start in row order, so the
    # short ones fill in behind the long ones instead of leaving a tail (measured:
    # bench/RESULTS.md, "longest first").
    order = np.lexsort((-ends, num_tokens != 1))
    states = [states[row] for row in order]
    num_tokens, starts, ends = num_tokens[order], starts[order], ends[order]
    spec = out.scheduled_spec_decode_tokens
    input_ids, pending = _input_ids(states, starts, ends, spec, in_flight)
    max_blocks = max(s.num_blocks for s in states)
    block_tables = np.full((len(states), max_blocks), NULL_BLOCK_ID, np.int64)
    for row, state in enumerate(states):
        block_tables[row, : state.num_blocks] = state.block_table[: state.num_blocks]
    # Each token's row and position: decode rows are one token at `start`.
    token_rows = np.repeat(np.arange(len(states)), num_tokens)
    cu_seqlens_q = np.concatenate(([0], np.cumsum(num_tokens)))
    positions = np.arange(len(input_ids)) - cu_seqlens_q[token_rows] + starts[token_rows]
    slots = block_tables[token_rows, positions // bs] * bs + positions % bs
    # The last input token of a request (known or pending): sample the next one.
    sampled = ends >= np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
    logits_indices = cu_seqlens_q[1:][sampled] - 1
    sampled_states = [s for s, keep in zip(states, sampled, strict=True) if keep]
    sampled_positions = ends[sampled]
    drafts, logits_indices, sampled_positions = _rows_with_drafts(
        spec, sampled_states, logits_indices, sampled_positions
    )
    plan = sampling.plan(sampled_states, sampled_positions.tolist(), drafts)
    race = plan.arrays if isinstance(plan, RaceRows) else None
    # NOTE: the pending tokens' places and rows ride in the same copy, after the inputs.
    fill = np.array(pending, np.int64).T.ravel()
    parts = [np.array(input_ids, np.int64), positions, slots, logits_indices]
    if race is not None:
        parts += race
    packed_longs = pack_aligned(parts, np.int64)
    copied = to_device(np.concatenate((packed_longs, fill)), device)
    longs = copied[: len(packed_longs)]
    if pending:
        assert in_flight is not None
        where, rows = copied[len(longs) :].view(2, -1)
        longs.index_copy_(0, where, in_flight.sampled_token_ids[rows])
    packed = PackedStep(
        longs=longs,
        ints=to_device(pack_aligned((block_tables.ravel(), cu_seqlens_q, ends), np.int32), device),
        num_tokens=len(input_ids),
        num_seqs=len(states),
        max_blocks=max_blocks,
        num_sampled=len(logits_indices),
        query_lens_cpu=num_tokens.tolist(),
        seq_lens_cpu=ends.tolist(),
        race=race is not None,
    )
    lora_batch = None
    if lora is not None:
        lora_batch = lora.prepare_step([s.lora_name for s in states], num_tokens)
    return ModelInputs(
        step=packed.unpack(),
        sampled_req_ids=[s.req_id for s in sampled_states],
        sampled_positions=sampled_positions.tolist(),
        packed=packed,
        lora=lora_batch,
        drafts=drafts,
        sampling=plan,
    )


def _input_ids(
    states: list[CachedRequestState],
    starts: np.ndarray,
    ends: np.ndarray,
    spec: dict[RequestId, list[int]],
    in_flight: InFlight | None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """The step's input token ids, and the (token index, row in the step in flight) of each
    input that step samples (not known yet: a placeholder here, filled on the device)."""
    input_ids: list[int] = []
    pending: list[tuple[int, int]] = []
    for state, start, end in zip(states, starts.tolist(), ends.tolist(), strict=True):
        known = state.token_ids[start:end]
        input_ids += known
        if spec and state.req_id in spec:  # its last token, then its drafts
            input_ids += spec[state.req_id]
        elif len(known) < end - start:  # only ever the last input token
            assert in_flight is not None
            assert len(known) == end - start - 1
            pending.append((len(input_ids), in_flight.row_of[state.req_id]))
            input_ids.append(0)
    return input_ids, pending


def _rows_with_drafts(
    spec: dict[RequestId, list[int]],
    sampled: list[CachedRequestState],
    last_rows: np.ndarray,
    positions: np.ndarray,
) -> tuple[list[list[int]] | None, np.ndarray, np.ndarray]:
    """With drafts in the step (`spec`): each sampled request's drafts, the logits rows (a
    request with k drafts samples after each of its last k + 1 tokens, not only its last) and
    each request's first sampled position. Without: None, and the rows and positions as given."""
    if not spec:
        return None, last_rows, positions
    drafts = [spec.get(s.req_id, []) for s in sampled]
    counts = np.fromiter((len(d) + 1 for d in drafts), np.int64, len(drafts))
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.repeat(last_rows + 1 - counts, counts) + within
    return drafts, rows, positions - (counts - 1)
