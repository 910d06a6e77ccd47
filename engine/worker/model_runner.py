"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache and samples.

Its inputs (per-request state, the step flattened into varlen tensors) are built in
worker/inputs.py; it computes logits only for the requests that reach their last known token
this step, and samples them through `sample(logits, batch)` (engine/sample/).
"""

from __future__ import annotations

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.config import ModelConfig
from kvfleet.engine.core.request import RequestId
from kvfleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvfleet.engine.lora.manager import LoRAManager
from kvfleet.engine.lora.ops import LoRABatch
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.parallel.group import TPGroup
from kvfleet.engine.parallel.step_message import StepInputs
from kvfleet.engine.protocol.openai import MAX_LOGPROBS
from kvfleet.engine.sample.batch import (
    ArgmaxBatch,
    RaceBatch,
    RaceRows,
    SamplingBatch,
    SamplingPlanner,
)
from kvfleet.engine.sample.rejection import greedy_verdicts
from kvfleet.engine.sample.sampler import needs_gathered_logits, sample
from kvfleet.engine.sample.torch_sampler import SamplerOutput, SamplingMetadata
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.cuda_graphs import DecodeGraphs
from kvfleet.engine.worker.inputs import (
    CachedRequestState,
    InFlight,
    prepare_inputs,
    update_states,
)
from kvfleet.engine.worker.prefill_graphs import PrefillGraphs
from kvfleet.engine.worker.swap_space import SwapSpace


class LaunchedStep:
    """A step queued on the device. Its sampled tokens (and logprobs) travel back to the host
    asynchronously; until they arrive, the next step reads the tokens it feeds from
    `results.sampled_token_ids` on the device (never after a step with drafts: how many of
    them are kept decides what comes next).

    A step launched with its sampling held (`ModelRunner.launch(..., hold_sampling=True)`)
    has its forward queued and waits for `ModelRunner.sample(step, token_mask)`: the host
    fills the grammars' masks meanwhile."""

    def __init__(
        self,
        scheduler_output: SchedulerOutput,
        sampled_req_ids: list[RequestId],
        num_logprobs: list[int | None],
        drafts: list[list[int]] | None = None,
        judge_on_host: bool = False,
    ) -> None:
        """`judge_on_host`: the results are each logits row's argmax (an all-greedy step with
        `drafts`, `ArgmaxBatch`); the drafts are judged here, on the host."""
        self.scheduler_output = scheduler_output
        self.sampled_req_ids = sampled_req_ids
        self.num_logprobs = num_logprobs
        self.results: SamplerOutput | None = None
        self.drafts = drafts
        self.judge_on_host = judge_on_host
        self.ready: torch.cuda.Event | None = None
        self._host: list[torch.Tensor] = []
        self.held: tuple[torch.Tensor, SamplingBatch] | None = None  # logits and plan to sample

    @property
    def logits_rows(self) -> list[RequestId]:
        """The request of each logits row (k + 1 rows for a request verifying k drafts)."""
        if self.drafts is None:
            return self.sampled_req_ids
        return [
            r
            for r, d in zip(self.sampled_req_ids, self.drafts, strict=True)
            for _ in range(len(d) + 1)
        ]

    def sampled(self, results: SamplerOutput) -> None:
        """The step's sampling is queued: start copying its results to the host."""
        self.results, self.held = results, None
        on_device = [results.sampled_token_ids]
        if self.drafts is not None and not self.judge_on_host:
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
        elif self.judge_on_host:
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

    def in_flight(self) -> InFlight | None:
        """What the next step reads of this one's tokens on the device (never after a step
        with drafts: how many of them are kept decides what comes next)."""
        if self.results is None:
            return None
        row_of = {req_id: row for row, req_id in enumerate(self.sampled_req_ids)}
        return InFlight(row_of, self.results.sampled_token_ids)


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
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """The KV cache comes later (`allocate_kv_cache`), once its size is known; its elements
        are `kv_cache_dtype` (default: the model's dtype; float8_e4m3fn: scaled per layer)."""
        self.model = model
        self.lora = lora
        self.config = model.config
        self.block_size = block_size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.swap_space: SwapSpace | None = None  # host blocks of swapped-out requests
        self.requests: dict[RequestId, CachedRequestState] = {}
        self.sampling = SamplingPlanner(self.config.vocab_size, device)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self._in_flight: InFlight | None = None  # the last step launched
        self.ranks_in_step = False  # a step's forward was broadcast to the other ranks, not run

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] (an FP8
        cache's blocks head-major: `attention.metadata.cache_views`)."""
        config = self.config
        shape = (2, num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]

    @property
    def num_swap_blocks(self) -> int:
        """Host blocks for swapped-out requests (0: preempted requests are recomputed)."""
        return self.swap_space.num_blocks if self.swap_space is not None else 0

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

        metadata = AttentionMetadata.one_prompt(
            torch.arange(max_num_tokens, device=self.device) + self.block_size,
            torch.tensor(block_ids, dtype=torch.int32, device=self.device),
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
        sample(logits, meta)
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

    def enable_prefill_graphs(self, max_tokens: int) -> None:
        """Replay steps holding prompt tokens, up to `max_tokens` of them, from CUDA graphs in
        pieces around attention (engine/worker/prefill_graphs.py)."""
        lora = (self.lora.context, self.lora.max_loras) if self.lora is not None else None
        self.prefill_graphs = PrefillGraphs(
            self.model, self.kv_caches, max_tokens, self.device, lora
        )
        self.prefill_graphs.capture_all()

    def release_graphs(self) -> None:
        """Free the graphs once the device is done with them (before leaving a
        tensor-parallel group: they hold its collectives)."""
        self.decode_graphs = None
        self.prefill_graphs = None
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
        self.sampling.forget()
        self._in_flight = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(
        self, scheduler_output: SchedulerOutput, hold_sampling: bool = False
    ) -> LaunchedStep:
        """Queue one step's forward and sampling on the device, and the copy of its results
        back; returns without waiting for them (`collect` does). `hold_sampling`: queue the
        forward only; `sample` queues the rest."""
        update_states(scheduler_output, self.requests, self.sampling, self.device)
        if self.swap_space is not None:
            self.swap_space.copy(self.kv_caches, scheduler_output.swaps)
        if scheduler_output.is_empty:
            return LaunchedStep(scheduler_output, [], [])
        # (its sampling planned, the sampling tensors queued: the last thing that can fail on
        # this rank alone comes before the broadcast; a step that fails after it leaves the
        # other ranks in its collectives)
        inputs = prepare_inputs(
            scheduler_output,
            self.requests,
            self.block_size,
            self.device,
            self.sampling,
            self._in_flight,
            self.lora,
        )
        if self.model.tp is not None:  # the other ranks run the same forward
            self.model.tp.broadcast_step(inputs.packed)
            self.ranks_in_step = True
        plan = inputs.sampling
        batch = self._race_batch(inputs.step) if isinstance(plan, RaceRows) else plan
        logits = self._forward(inputs.step, inputs.lora, needs_gathered_logits(batch))
        # (the other ranks wait in a race's collectives until it is sampled)
        self.ranks_in_step = self.model.tp is not None and isinstance(batch, RaceBatch)
        step = LaunchedStep(
            scheduler_output,
            inputs.sampled_req_ids,
            [self.requests[r].sampling_params.logprobs for r in inputs.sampled_req_ids],
            inputs.drafts,
            judge_on_host=isinstance(batch, ArgmaxBatch),
        )
        step.held = (logits, batch)
        if not hold_sampling:
            self.sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, token_mask: torch.Tensor | None = None) -> None:
        """Queue a launched step's sampling (`token_mask`: the grammars' bitmask, a row per
        logits row) and the copy of its results back."""
        assert step.held is not None, "the step was sampled already"
        logits, batch = step.held
        step.sampled(sample(logits, batch, token_mask))
        self.ranks_in_step = False
        self._in_flight = step.in_flight()

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's results; the requests still here take their tokens."""
        req_ids = list(step.scheduler_output.num_scheduled_tokens)
        assert step.held is None, "a step is collected after it is sampled"
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
            race = self._race_batch(step) if step.race is not None else None
            logits = self._forward(step, gather=race is None)
            if race is not None:
                sample(logits, race)

    def _forward(
        self, step: StepInputs, lora: LoRABatch | None = None, gather: bool = True
    ) -> torch.Tensor:
        """The forward (a graph replay for decode-only steps, replays in pieces for small steps
        with prompt tokens), then the sampled rows' logits (this rank's vocabulary shard unless
        `gather`). Every rank makes the same choices from the same inputs, so their collectives
        match."""
        graphs, pieces = self.decode_graphs, self.prefill_graphs
        num_tokens = step.input_ids.shape[0]
        try:
            if graphs is not None and graphs.can_run(step.metadata):
                hidden = graphs.run(step.input_ids, step.positions, step.metadata, lora)
            elif pieces is not None and pieces.can_run(num_tokens, lora is not None):
                hidden = pieces.run(step.input_ids, step.positions, step.metadata, lora)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        finally:
            if self.lora is not None:
                self.lora.clear_step()
        rows = hidden[step.logits_indices]
        return self.model.compute_logits(rows, gather=gather)

    def _race_batch(self, step: StepInputs) -> RaceBatch:
        """The race over this rank's vocabulary shard, from the step message's rows."""
        assert step.race is not None
        tp = self.model.tp
        race = step.race
        reduce_max = tp.all_reduce_max if tp is not None else None
        return RaceBatch(race.keys, race.bases, race.temperature, *self.vocab_columns, reduce_max)

    @property
    def vocab_columns(self) -> tuple[int, int]:
        """(the first vocabulary index, how many) of this rank's shard of the logits."""
        vocab = self.model.tp.plan.vocab if self.model.tp is not None else None
        return (vocab.start, vocab.size) if vocab else (0, self.config.vocab_size)

    @property
    def race_sampling(self) -> bool:
        """Whether steps that allow it sample by the vocabulary race (on CUDA by default)."""
        return self.sampling.race

    @race_sampling.setter
    def race_sampling(self, race: bool) -> None:
        self.sampling.race = race
