"""CUDA graphs for decode-only steps: one graph replay instead of ~130 kernel launches per step.

One graph per batch-size bucket, captured at startup, all sharing one memory pool and one
set of static input buffers. A step of B sequences runs the smallest bucket >= B; the padding
rows write their K/V into the null block and their outputs are dropped. With LoRA, each bucket
has a second graph that also runs the LoRA kernels over static grouping buffers; steps without
adapter tokens replay the plain one and pay nothing for LoRA.

With `max_query_len` q > 1 (speculative decoding: a token and its drafts per sequence), each
bucket also has a graph for steps of up to q tokens per sequence ("verification steps"): room
for bucket x q tokens, each sequence's count read from the copied cu_seqlens_q (the attention
kernel takes any count up to q), padding tokens after the last sequence's and padding
sequences of none.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_decode import split_counters
from kvfleet.engine.attention.triton_prompt import (
    FEW_QUERY_TOKENS,
    LONG_KV_TOKENS,
    SHORT_QUERY_TOKENS,
    splits_forced,
)
from kvfleet.engine.core.block_pool import NULL_BLOCK_ID
from kvfleet.engine.layers.moe import RealTokens
from kvfleet.engine.lora.layers import LoRAContext
from kvfleet.engine.lora.ops import LoRABatch, StaticLoRABatch
from kvfleet.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Decode batch sizes captured (up to the engine's max_num_seqs; larger steps run eagerly): to
# 1,024, vLLM's default concurrency on GPUs of 70 GiB and more.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        lora: tuple[LoRAContext, int] | None = None,  # the models' LoRA context, max_loras
        max_query_len: int = 1,
    ) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.max_query_len = max_query_len
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [
            next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
        ]
        self.max_batch = self.buckets[-1]
        n = self.max_batch * max_query_len  # tokens

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Static inputs every graph reads; a step copies its values in before replaying.
        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.slot_mapping = zeros(n, dtype=torch.int64)
        self.block_tables = zeros(n, max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.cu_seqlens_verify = zeros(self.max_batch + 1, dtype=torch.int32)  # (copied in)
        self.static_lora = StaticLoRABatch(n, lora[1], device) if lora else None
        # (bucket, query tokens per sequence, with LoRA) -> the graph and its output
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.real_tokens = RealTokens(model, device)  # (padding tokens meet no MoE expert)
        self.pool: Any = None  # the graphs' shared memory pool handle

    def capture_all(self) -> None:
        """Capture every bucket now (at startup), largest first so the pool fits them all; then
        compile the prefill kernels (`warm_up_prefill_kernels`)."""
        query_lens = sorted({1, self.max_query_len}, reverse=True)
        if self.kv_caches[0].is_cuda:  # (the decode kernel's split counters, outside any graph)
            split_counters(self.kv_caches[0].device, self.max_batch * self.kv_caches[0].shape[3])
        for bucket in reversed(self.buckets):
            for q in query_lens:
                for with_lora in (False, True) if self.lora else (False,):
                    if (bucket, q, with_lora) not in self.graphs:
                        self.graphs[bucket, q, with_lora] = self._capture(bucket, q, with_lora)
        self.warm_up_prefill_kernels()

    # Steps whose prompt-kernel launches compile apart: (query tokens, tokens cached before)
    # for each kind of triton_prompt's tiles: "short" (up to SHORT_QUERY_TOKENS), "few" (up to
    # FEW_QUERY_TOKENS), "chunks", "long" (LONG_KV_TOKENS of KV) — each run with its keys whole
    # and split in two.
    WARM_STEPS = (
        (2, 0),
        (SHORT_QUERY_TOKENS + 1, 0),
        (FEW_QUERY_TOKENS + 1, 0),
        (SHORT_QUERY_TOKENS + 1, LONG_KV_TOKENS - SHORT_QUERY_TOKENS - 1),
    )

    @torch.inference_mode()
    def warm_up_prefill_kernels(self) -> None:
        """One eager step of each of WARM_STEPS (one sequence, its K/V written into and read
        from the null block, its outputs dropped), at startup: Triton compiles a kernel variant
        the first time a step needs it, and a step of each kind would otherwise stall its
        batch for the compile (0.2-1.2 s on an H100) mid-serving; a prefix-cache hit that
        leaves a few prompt tokens to compute over a long prefix is the first short
        multi-token query a plain engine meets, and the first split one."""
        device = self.input_ids.device
        block_size = self.kv_caches[0].shape[2]
        width = self.block_tables.shape[1]
        for q, cached in self.WARM_STEPS:
            if q + cached > width * block_size:
                continue
            null = NULL_BLOCK_ID
            metadata = AttentionMetadata.one_prompt(
                torch.full((q,), null, dtype=torch.int64, device=device),
                torch.full((width,), null, dtype=torch.int32, device=device),
                cached,
            )
            input_ids = torch.zeros(q, dtype=torch.int64, device=device)
            positions = torch.arange(cached, cached + q, dtype=torch.int64, device=device)
            for num_splits in (1, 2):
                with splits_forced(num_splits):
                    self.model(input_ids, positions, self.kv_caches, metadata)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        num_seqs = len(metadata.query_lens_cpu)
        return metadata.max_seqlen_q <= self.max_query_len and num_seqs <= self.max_batch

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The model's hidden states [num_tokens, hidden] for a step `can_run` takes: a decode
        step (one token per sequence), else a verification step (up to max_query_len)."""
        num_tokens = input_ids.shape[0]
        num_seqs = metadata.seq_lens.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_seqs)]
        q = 1 if metadata.max_seqlen_q == 1 else self.max_query_len
        width = metadata.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables, non_blocking=True)
        if q > 1:  # padding sequences hold no tokens
            self.cu_seqlens_verify[: num_seqs + 1].copy_(metadata.cu_seqlens_q, non_blocking=True)
            self.cu_seqlens_verify[num_seqs + 1 : bucket + 1].fill_(num_tokens)
        # NOTE: padding rows must write into the null block, never into a live block left
        # there by an earlier, larger step.
        self.slot_mapping[num_tokens : bucket * q].fill_(NULL_BLOCK_ID)
        self.real_tokens.set(num_tokens)
        if lora is not None:
            assert self.static_lora is not None
            self.static_lora.stage(lora)
        key = (bucket, q, lora is not None)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:num_tokens]

    def _capture(
        self, bucket: int, q: int, with_lora: bool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        logger.info(
            "capturing a CUDA graph for steps of up to %d sequences of %d tokens%s",
            bucket,
            q,
            " with LoRA" if with_lora else "",
        )
        tokens = bucket * q
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables[:bucket],
            cu_seqlens_q=(self.cu_seqlens_q if q == 1 else self.cu_seqlens_verify)[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            max_seqlen_q=q,
            max_seqlen_k=self.block_tables.shape[1] * self.kv_caches[0].shape[2],
            query_lens_cpu=[q] * bucket,
            seq_lens_cpu=[q] * bucket,
        )

        static_lora = None
        if with_lora:
            assert self.static_lora is not None
            static_lora = self.static_lora.batch(tokens)

        def forward() -> torch.Tensor:
            if self.lora is not None:
                self.lora[0].batch = static_lora
            try:
                hidden: torch.Tensor = self.model(
                    self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, metadata
                )
            finally:
                if self.lora is not None:
                    self.lora[0].batch = None
            return hidden

        with self.real_tokens.capturing(tokens):
            # Warm up on a side stream first: Triton compiles its kernels outside the capture.
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = forward()
        self.pool = graph.pool()
        return graph, hidden
