"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache and samples.

It keeps a small state per request (token ids, block table, generator) updated from the
scheduler's diffs, flattens the step into varlen tensors, and computes logits only for the
requests that reach their last known token this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.config import ModelConfig
from kvfleet.engine.core.block_pool import NULL_BLOCK_ID
from kvfleet.engine.core.request import RequestId
from kvfleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvfleet.engine.layers.host_copy import to_device
from kvfleet.engine.lora.manager import LoRAManager
from kvfleet.engine.lora.ops import LoRABatch
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.parallel.group import TPGroup
from kvfleet.engine.parallel.step_message import PackedStep, RaceInputs, StepInputs, pack_aligned
from kvfleet.engine.protocol.openai import MAX_LOGPROBS
from kvfleet.engine.sample.rejection import StepDrafts, greedy_verdicts, sample_with_drafts
from kvfleet.engine.sample.torch_sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    position_seed,
)
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.cuda_graphs import DecodeGraphs


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


# A batch's race temperatures (float64, 0 for greedy) and its seeded rows' seeds.
_RaceRows = tuple[np.ndarray, dict[int, int]]


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


class LaunchedStep:
    """A step queued on the device. Its sampled tokens (and logprobs) travel back to the host
    asynchronously; until they arrive, the next step reads the tokens it feeds from
    `results.sampled_token_ids` on the device (never after a step with drafts: how many of
    them are kept decides what comes next)."""

    def __init__(
        self,
        scheduler_output: SchedulerOutput,
        sampled_req_ids: list[RequestId],
        num_logprobs: list[int | None],
        results: SamplerOutput | None,
        drafts: list[list[int]] | None = None,
        greedy_drafts: bool = False,
    ) -> None:
        """`greedy_drafts`: every request of a step with `drafts` decodes greedily, and the
        results are the argmax of each logits row; the drafts are judged here, on the host."""
        self.scheduler_output = scheduler_output
        self.sampled_req_ids = sampled_req_ids
        self.num_logprobs = num_logprobs
        self.results = results
        self.drafts = drafts
        self.greedy_drafts = greedy_drafts
        self.row_of = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
        self.ready: torch.cuda.Event | None = None
        self._host: list[torch.Tensor] = []
        if results is not None:
            on_device = [results.sampled_token_ids]
            if drafts is not None and not greedy_drafts:
                assert results.num_accepted is not None
                on_device.append(results.num_accepted)
            if results.logprobs is not None:
                assert results.logprob_token_ids is not None
                assert results.sampled_ranks is not None
                on_device += [results.logprob_token_ids, results.logprobs, results.sampled_ranks]
            # NOTE: into pinned memory, without waiting; `ready` marks the copies done.
            self._host = [t.to("cpu", non_blocking=True) for t in on_device]
            if results.sampled_token_ids.is_cuda:
                self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self.ready.record()

    def host_results(self) -> tuple[list[list[int]], dict[RequestId, list[TokenLogprobs]]]:
        """Each sampled row's tokens (one, or its kept drafts and one), and the logprobs of the
        requests that asked."""
        host = list(self._host)
        last: list[int] = host.pop(0).tolist()
        if self.drafts is None:
            tokens = [[token] for token in last]
        elif self.greedy_drafts:
            tokens = greedy_verdicts(self.drafts, last)
        else:
            kept: list[int] = host.pop(0).tolist()
            tokens = [[*d[:a], t] for d, a, t in zip(self.drafts, kept, last, strict=True)]
        logprobs: dict[RequestId, list[TokenLogprobs]] = {}
        if host:
            ids, values, ranks = (t.tolist() for t in host)
            for row, (req_id, k) in enumerate(
                zip(self.sampled_req_ids, self.num_logprobs, strict=True)
            ):
                if k is not None:
                    top = slice(1, 1 + k)
                    logprobs[req_id] = [
                        TokenLogprobs(
                            ids[row][0], values[row][0], ranks[row], ids[row][top], values[row][top]
                        )
                    ]
        return tokens, logprobs


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * element
    return per_token * block_size * config.num_hidden_layers


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        lora: LoRAManager | None = None,
    ) -> None:
        """The KV cache comes later (`allocate_kv_cache`), once its size is known."""
        self.model = model
        self.lora = lora
        self.config = model.config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[RequestId, CachedRequestState] = {}
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphs | None = None
        self._last_sampling: tuple[tuple[RequestId, ...], SamplingMetadata] | None = None
        # Sampled rows by the vocabulary race on CUDA (engine/sample/gumbel_race.py): per batch,
        # its temperatures and seeds, or None where a row needs the torch sampler.
        self.race_sampling = device.type == "cuda"
        self._last_race: tuple[tuple[RequestId, ...], _RaceRows | None] | None = None
        self._step_keys = np.random.default_rng(torch.initial_seed())
        self._latest: LaunchedStep | None = None  # the last step launched
        self.ranks_in_step = False  # a step's forward was broadcast to the other ranks, not run

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
        config = self.config
        shape = (2, num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]

    @torch.inference_mode()
    def profile_peak_bytes(self, max_num_tokens: int, max_num_seqs: int) -> int:
        """Device memory the largest step needs beyond the weights and the KV cache: a forward
        over `max_num_tokens` prompt tokens, then logits and sampling (top-k, top-p, logprobs)
        for `max_num_seqs` rows. Runs it once, on a KV cache just big enough."""
        assert self.device.type == "cuda", "profiling measures CUDA memory"
        assert not self.kv_caches, "profile before the KV cache is allocated"
        num_blocks = -(-max_num_tokens // self.block_size) + 1
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.allocate_kv_cache(num_blocks)
        kv_bytes = torch.cuda.memory_allocated(self.device) - before
        block_ids = list(range(1, num_blocks))

        def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=torch.arange(max_num_tokens, device=self.device) + self.block_size,
            block_tables=ints([block_ids]),
            cu_seqlens_q=ints([0, max_num_tokens]),
            seq_lens=ints([max_num_tokens]),
            max_seqlen_q=max_num_tokens,
            max_seqlen_k=max_num_tokens,
            query_lens_cpu=[max_num_tokens],
            seq_lens_cpu=[max_num_tokens],
        )
        positions = torch.arange(max_num_tokens, device=self.device)
        hidden = self.model(positions % self.config.vocab_size, positions, self.kv_caches, metadata)
        rows = min(max_num_seqs, max_num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        params = SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, logprobs=MAX_LOGPROBS, presence_penalty=0.5
        )
        meta = SamplingMetadata.build(
            [params] * rows, [[1]] * rows, [[2]] * rows, {}, self.config.vocab_size, self.device
        )
        self.sampler(logits, meta)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - kv_bytes
        del hidden, logits, meta
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def enable_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, max_query_len: int = 1
    ) -> None:
        """Replay decode-only steps from CUDA graphs (needs graph-safe kernels: Triton), and
        with `max_query_len` > 1 steps of up to that many tokens per sequence (drafts)."""
        max_blocks = -(-max_model_len // self.block_size)
        lora = (self.lora.context, self.lora.max_loras) if self.lora is not None else None
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, max_num_seqs, max_blocks, self.device, lora, max_query_len
        )
        self.decode_graphs.capture_all()

    def release_graphs(self) -> None:
        """Free the decode graphs once the device is done with them (before leaving a
        tensor-parallel group: they hold its collectives)."""
        self.decode_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forget_requests(self) -> None:
        """Drop every request's state (after a failed step: all are scheduled anew).
        RuntimeError if the step failed with the other ranks in its collectives."""
        if self.ranks_in_step:
            raise RuntimeError(
                "a step failed inside its forward: the tensor-parallel ranks are out of step"
            )
        self.requests.clear()
        self._last_sampling = self._last_race = None
        self._latest = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's forward and sampling on the device, and the copy of its results
        back; returns without waiting for them (`collect` does)."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return LaunchedStep(scheduler_output, [], [], None)
        inputs = self._prepare_inputs(scheduler_output)
        states = [self.requests[req_id] for req_id in inputs.sampled_req_ids]
        sampling = drafts = None
        # Greedy requests only (no penalties, no logprobs): each row's argmax comes back and
        # the drafts are judged on the host, no sampling tensors built nor verdicts queued.
        greedy_drafts = inputs.drafts is not None and all(
            s.sampling_params.is_greedy
            and not s.sampling_params.has_penalties
            and s.sampling_params.logprobs is None
            for s in states
        )
        if inputs.drafts is not None and not greedy_drafts:
            sampling, drafts = self._draft_sampling(states, inputs.drafts, inputs.sampled_positions)
        elif inputs.step.race is None:
            # NOTE: built before the forward is queued (the copies are asynchronous anyway).
            sampling = self._sampling_metadata(states)
        if sampling is not None and drafts is None:
            for row, generator in sampling.generators.items():
                seed = states[row].sampling_params.seed
                assert seed is not None
                generator.manual_seed(position_seed(seed, inputs.sampled_positions[row]))
        # NOTE: the last thing that can fail on this rank alone comes before the broadcast: a
        # step that fails after it leaves the other ranks in its collectives.
        if self.model.tp is not None:  # the other ranks run the same forward
            self.model.tp.broadcast_step(inputs.packed)
            self.ranks_in_step = True
        sampled = self._sample(inputs.step, inputs.lora, sampling, drafts, greedy_drafts)
        self.ranks_in_step = False
        assert sampled is not None
        step = LaunchedStep(
            scheduler_output,
            inputs.sampled_req_ids,
            [s.sampling_params.logprobs for s in states],
            sampled,
            inputs.drafts,
            greedy_drafts,
        )
        self._latest = step
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's results; the requests still here take their tokens."""
        req_ids = list(step.scheduler_output.num_scheduled_tokens)
        if step.results is None:
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], [None] * len(req_ids))
        if step.ready is not None:
            step.ready.synchronize()
        tokens, logprobs = step.host_results()
        by_req = dict(zip(step.sampled_req_ids, tokens, strict=True))
        for req_id, new in by_req.items():
            state = self.requests.get(req_id)
            if state is not None:  # (gone if finished or preempted since)
                state.token_ids += new
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[by_req.get(r, []) for r in req_ids],
            logprobs=[logprobs.get(r) for r in req_ids],
        )

    @torch.inference_mode()
    def serve_steps(self, tp: TPGroup) -> None:
        """Ranks > 0: run every step rank 0 broadcasts (forward and logits, for their
        collectives; rank 0 samples, or all race their vocabulary shards) until it stops."""
        while (step := tp.receive_step()) is not None:
            self._sample(step)

    def _sample(
        self,
        step: StepInputs,
        lora: LoRABatch | None = None,
        sampling: SamplingMetadata | None = None,
        drafts: StepDrafts | None = None,
        argmax: bool = False,
    ) -> SamplerOutput | None:
        """The forward (a graph replay for decode-only steps), then the sampled rows' tokens:
        by a race over the vocabulary (shards), else by the sampler from all the logits (None
        without `sampling`: a tensor-parallel worker only joins the collectives), verifying
        `drafts` where the step has some, or each row's `argmax` (greedy drafts, judged on the
        host). Every rank makes the same choices from the same inputs, so their collectives
        match."""
        graphs = self.decode_graphs
        try:
            if graphs is not None and graphs.can_run(step.metadata):
                hidden = graphs.run(step.input_ids, step.positions, step.metadata, lora)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        finally:
            if self.lora is not None:
                self.lora.clear_step()
        rows = hidden[step.logits_indices]
        if step.race is not None:
            return SamplerOutput(self._race(rows, step.race))
        logits = self.model.compute_logits(rows)
        if argmax:
            return SamplerOutput(logits.argmax(dim=-1))
        if sampling is None:
            return None
        if drafts is not None:
            return sample_with_drafts(logits, sampling, drafts)
        return self.sampler(logits, sampling)

    def _race(self, rows: torch.Tensor, inputs: RaceInputs) -> torch.Tensor:
        """Each row's token by the vocabulary race: each rank over its shard, then the best."""
        from kvfleet.engine.sample.gumbel_race import race, winners

        logits = self.model.compute_logits(rows, gather=False)
        tp = self.model.tp
        vocab = tp.plan.vocab if tp is not None else None
        first, count = (vocab.start, vocab.size) if vocab else (0, self.config.vocab_size)
        packed = race(logits, inputs.temperature, inputs.keys, inputs.bases, first, count)
        if tp is not None:
            tp.all_reduce_max(packed)
        return winners(packed)

    def _update_states(self, out: SchedulerOutput) -> None:
        if out.finished_req_ids or out.scheduled_new_reqs:
            # an id may come back with other parameters
            self._last_sampling = self._last_race = None
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)  # seeded before each draw
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
            self.requests[new.req_id] = state
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                state.add_blocks(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """Flatten the step: per-token arrays built with numpy, sent in two copies."""
        bs = self.block_size
        states = [self.requests[req_id] for req_id in out.num_scheduled_tokens]
        num_tokens = np.fromiter(out.num_scheduled_tokens.values(), np.int64, len(states))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        ends = starts + num_tokens
        # Longest sequences first: attention programs start in row order, so the short ones
        # fill in behind the long ones instead of leaving a tail (decode attention over 256
        # sequences of 192-1,280 tokens, 16 query / 4 KV heads, on an H200: 111 us against 119
        # in arrival order).
        order = np.argsort(-ends, kind="stable")
        states = [states[row] for row in order]
        num_tokens, starts, ends = num_tokens[order], starts[order], ends[order]
        input_ids: list[int] = []
        # (token index, row in the step in flight): inputs sampled by that step, not known yet
        pending: list[tuple[int, int]] = []
        spec = out.scheduled_spec_decode_tokens
        for state, start, end in zip(states, starts.tolist(), ends.tolist(), strict=True):
            known = state.token_ids[start:end]
            input_ids += known
            if spec and state.req_id in spec:  # its last token, then its drafts
                input_ids += spec[state.req_id]
            elif len(known) < end - start:  # only ever the last input token
                assert self._latest is not None
                assert len(known) == end - start - 1
                pending.append((len(input_ids), self._latest.row_of[state.req_id]))
                input_ids.append(0)
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
        race = None if spec else self._race_inputs(sampled_states, sampled_positions)
        # NOTE: the pending tokens' places and rows ride in the same copy, after the inputs.
        fill = np.array(pending, np.int64).T.ravel()
        parts = [np.array(input_ids, np.int64), positions, slots, logits_indices]
        if race is not None:
            parts += race
        packed_longs = pack_aligned(parts, np.int64)
        copied = to_device(np.concatenate((packed_longs, fill)), self.device)
        longs = copied[: len(packed_longs)]
        if pending:
            assert self._latest is not None
            assert self._latest.results is not None
            where, rows = copied[len(longs) :].view(2, -1)
            longs.index_copy_(0, where, self._latest.results.sampled_token_ids[rows])
        packed = PackedStep(
            longs=longs,
            ints=to_device(
                pack_aligned((block_tables.ravel(), cu_seqlens_q, ends), np.int32), self.device
            ),
            num_tokens=len(input_ids),
            num_seqs=len(states),
            max_blocks=max_blocks,
            num_sampled=len(logits_indices),
            query_lens_cpu=num_tokens.tolist(),
            seq_lens_cpu=ends.tolist(),
            race=race is not None,
        )
        lora = None
        if self.lora is not None:
            lora = self.lora.prepare_step([s.lora_name for s in states], num_tokens)
        return ModelInputs(
            step=packed.unpack(),
            sampled_req_ids=[s.req_id for s in sampled_states],
            sampled_positions=sampled_positions.tolist(),
            packed=packed,
            lora=lora,
            drafts=drafts,
        )

    def _race_inputs(
        self, states: list[CachedRequestState], positions: np.ndarray
    ) -> list[np.ndarray] | None:
        """The vocabulary race's keys, bases and temperatures (float64 bits) for the sampled
        rows, or None where the race cannot serve the step (not on CUDA, or a row needs the
        whole distribution: top-k/p, min-p, penalties, logprobs)."""
        if not self.race_sampling or not states:
            return None
        key = tuple(s.req_id for s in states)
        if self._last_race is None or self._last_race[0] != key:
            params = [s.sampling_params for s in states]
            if any(p.needs_distribution for p in params):
                self._last_race = (key, None)
            else:
                temperatures = [0.0 if p.is_greedy else p.temperature for p in params]
                seeds = {row: p.seed for row, p in enumerate(params) if p.seed is not None}
                self._last_race = (key, (np.array(temperatures, np.float64), seeds))
        rows = self._last_race[1]
        if rows is None:
            return None
        temperature, seeds = rows
        # Unseeded rows: the step's key, each row its own stretch of the stream.
        keys = np.full(len(states), self._step_keys.integers(1 << 62), np.int64)
        bases = np.arange(len(states), dtype=np.int64) * self.config.vocab_size
        for row, seed in seeds.items():
            keys[row], bases[row] = position_seed(seed, int(positions[row])), 0
        return [keys, bases, temperature.view(np.int64)]

    def _draft_sampling(
        self, states: list[CachedRequestState], drafts: list[list[int]], positions: list[int]
    ) -> tuple[SamplingMetadata, StepDrafts]:
        """A speculative step's sampling tensors, one row per logits row (k + 1 per request
        with k drafts), and its drafts; `positions`: each request's first sampled position."""
        counts = [len(d) + 1 for d in drafts]
        rows = [s for s, count in zip(states, counts, strict=True) for _ in range(count)]
        # (penalties read the outputs: requests with them carry no drafts)
        penalized = any(s.sampling_params.has_penalties for s in states)
        meta = SamplingMetadata.build(
            [s.sampling_params for s in rows],
            [s.token_ids[: s.num_prompt_tokens] if penalized else [] for s in rows],
            [s.token_ids[s.num_prompt_tokens :] if penalized else [] for s in rows],
            {},
            self.config.vocab_size,
            self.device,
        )
        step_drafts = StepDrafts(
            num_drafts=[count - 1 for count in counts],
            token_ids=to_device(np.array([t for d in drafts for t in d], np.int64), self.device),
            greedy=[s.sampling_params.is_greedy for s in states],
            keys={
                i: [position_seed(seed, positions[i] + j) for j in range(count)]
                for i, (s, count) in enumerate(zip(states, counts, strict=True))
                if (seed := s.sampling_params.seed) is not None and not s.sampling_params.is_greedy
            },
        )
        return meta, step_drafts

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        """The batch's sampling tensors; reused while the same requests are sampled in the same
        order (steady decoding), unless penalties need this step's output tokens."""
        key = tuple(s.req_id for s in states)
        cached = self._last_sampling
        if cached is not None and cached[0] == key:
            return cached[1]
        meta = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.token_ids[: s.num_prompt_tokens] for s in states],
            [s.token_ids[s.num_prompt_tokens :] for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.config.vocab_size,
            self.device,
        )
        self._last_sampling = None if meta.presence_penalty is not None else (key, meta)
        return meta


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
