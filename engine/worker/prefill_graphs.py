"""CUDA graphs for steps that hold prompt tokens, captured in pieces between attention calls.

A step with prompt tokens used to run eagerly: ~300 kernel launches from Python, 8-10 ms of host
time on an 8B model, more than the GPU needs for a prefix hit's 32 new tokens or a 128-token
prompt. Such a step's attention cannot be captured once for all steps of its size (its grid,
tiles and splits follow each step's sequence and query lengths); everything else can, by token
count alone. So for each bucket of token counts the forward is captured as one graph per
stretch between two attention calls — the embedding and layer 0's projections up to its
attention; layer 0's output projection and MLP and layer 1's projections; ...; the last
layer's MLP and the final norm — all in one memory pool. A replay runs the pieces in order and
each layer's attention eagerly in between (`AttentionLayer.attend`, with the step's own
metadata): it reads the query its piece left in a static buffer and writes its output where
the next piece reads it. (vLLM's piecewise graphs split the model at attention the same way,
through torch.compile.)

The break is `AttentionLayer.graph_break`: while a forward runs in pieces (`forward_in_pieces`,
also the warm-up before each capture) every backend calls it in place of `attend`. The K/V
write happens inside the pieces, through the static slot mapping: padding tokens write into
the null block. With LoRA each bucket is captured twice, without adapters and with them (the
LoRA kernels' grids follow the token count alone; a step's grouping of tokens by adapter slot is
copied into static buffers as its ids are). Steps whose forward would differ from the captured
one run eagerly instead: while FP8 KV scales still wait to be measured on the first prompt.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet.engine.attention.metadata import AttentionLayer, AttentionMetadata
from kvfleet.engine.core.block_pool import NULL_BLOCK_ID
from kvfleet.engine.layers.grid import cdiv
from kvfleet.engine.layers.moe import RealTokens
from kvfleet.engine.lora.layers import LoRAContext
from kvfleet.engine.lora.ops import LoRABatch, StaticLoRABatch
from kvfleet.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 512)
# Above the last of BUCKETS, every multiple of this up to `max_tokens`: a 1,024-token prompt
# beside a few decodes padded to 2,048 tokens cost twice its matmuls (online TTFT p50 62 against
# 44 ms eager, H100, bench/RESULTS.md 2026-11-28 session 21).
LARGE_BUCKET_STEP = 256


@dataclass
class _Break:
    """One layer's attention between two pieces: its backend and cache, the static query the
    piece before leaves and the static output the piece after reads ([bucket, heads, dim])."""

    backend: AttentionLayer
    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_scales: torch.Tensor | None
    out: torch.Tensor


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]
    breaks: list[_Break]
    hidden: torch.Tensor  # [bucket, hidden]: the last piece's output


def prefill_graph_bytes(model: LlamaForCausalLM, max_tokens: int, dtype: torch.dtype) -> int:
    """The static query and output buffers PrefillGraphs keeps (two per layer, shared by the
    buckets), beside what its pool holds (one step's activations at `max_tokens`)."""
    config = model.config
    per_layer = max_tokens * config.num_attention_heads * config.head_dim
    return 2 * config.num_hidden_layers * per_layer * dtype.itemsize


def buckets(max_tokens: int) -> list[int]:
    """The token counts captured for steps of up to `max_tokens` prompt tokens (each step pads
    to the first that holds it)."""
    large = range(BUCKETS[-1] + LARGE_BUCKET_STEP, max_tokens, LARGE_BUCKET_STEP)
    return [b for b in (*BUCKETS, *large) if b < max_tokens] + [max_tokens]


class PrefillGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        device: torch.device,
        lora: tuple[LoRAContext, int] | None = None,  # the model's LoRA context, max_loras
    ) -> None:
        assert lora is None or lora[0].use_triton, "the torch LoRA path reads host lists"
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.buckets = buckets(max_tokens)
        self.max_tokens = max_tokens
        self.device = device
        self.attentions = _attentions(model)
        # (one backend per layer, or one shared: each set once)
        self.backends = list({id(a.backend): a.backend for a in self.attentions}.values())
        n = max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), NULL_BLOCK_ID, dtype=torch.int64, device=device)
        config = model.config
        heads, dim = config.num_attention_heads // _tp_size(model), config.head_dim
        # (zeroed: a padding row reads whatever an earlier step left, never uninitialized NaNs)
        dtype = model.embed_tokens.weight.dtype
        self.queries = [
            torch.zeros(n, heads, dim, dtype=dtype, device=device) for _ in model.layers
        ]
        self.outputs = [
            torch.zeros(n, heads, dim, dtype=dtype, device=device) for _ in model.layers
        ]
        self.static_lora = StaticLoRABatch(n, lora[1], device) if lora else None
        self.pieces: dict[tuple[int, bool], _Pieces] = {}  # (bucket, with LoRA) -> its pieces
        self.real_tokens = RealTokens(model, device)  # (padding tokens meet no MoE expert)
        self.pool: Any = None

    def can_run(self, num_tokens: int, with_lora: bool) -> bool:
        """Whether a step of `num_tokens` (`with_lora` adapters) replays from pieces (not one
        before the FP8 KV scales are measured)."""
        return (
            num_tokens <= self.max_tokens
            and (self.lora is not None or not with_lora)
            and not any(attention.calibrate_kv for attention in self.attentions)
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now (at startup), largest first so the pool fits them all."""
        self.pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            for with_lora in (False, True) if self.lora else (False,):
                self.pieces[bucket, with_lora] = self._capture(bucket, with_lora)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The model's hidden states [num_tokens, hidden] for a step `can_run` takes."""
        n = input_ids.shape[0]
        bucket = self._bucket(n)
        self._stage(input_ids, positions, metadata.slot_mapping, bucket, lora)
        pieces = self.pieces[bucket, lora is not None]
        for graph, cut in zip(pieces.graphs, [*pieces.breaks, None], strict=True):
            graph.replay()
            if cut is not None:
                cut.backend.attend(cut.q[:n], cut.kv_cache, metadata, cut.kv_scales, cut.out[:n])
        return pieces.hidden[:n]

    @torch.inference_mode()
    def forward_in_pieces(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The forward run eagerly the way the pieces split it (through the static buffers,
        attention at each break with `metadata`): what a replay computes."""
        n = input_ids.shape[0]
        bucket = self._bucket(n)
        self._stage(input_ids, positions, metadata.slot_mapping, bucket, lora)

        def attend_now(cut: _Break) -> None:
            cut.backend.attend(cut.q[:n], cut.kv_cache, metadata, cut.kv_scales, cut.out[:n])

        hidden, _ = self._forward_with_breaks(bucket, attend_now, lora is not None)
        return hidden[:n]

    def _bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def _stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        bucket: int,
        lora: LoRABatch | None = None,
    ) -> None:
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        # NOTE: padding tokens must write their K/V into the null block, never into a live
        # block an earlier, larger step's token left there.
        self.slot_mapping[n:bucket].fill_(NULL_BLOCK_ID)
        self.real_tokens.set(n)
        if lora is not None:
            assert self.static_lora is not None
            self.static_lora.stage(lora)

    def _forward_with_breaks(
        self, bucket: int, at_break: Callable[[_Break], None], with_lora: bool
    ) -> tuple[torch.Tensor, list[_Break]]:
        """The model over the first `bucket` static inputs (`with_lora`: their static adapter
        grouping), each layer's attention replaced by copying its query into the layer's static
        buffer and calling `at_break` (which may attend, or end one graph's capture and begin
        the next)."""
        breaks: list[_Break] = []

        def graph_break(
            backend: AttentionLayer,
            q: torch.Tensor,
            kv_cache: torch.Tensor,
            metadata: AttentionMetadata,
            kv_scales: torch.Tensor | None,
        ) -> torch.Tensor:
            layer = len(breaks)
            query, out = self.queries[layer][:bucket], self.outputs[layer][:bucket]
            query.copy_(q)
            cut = _Break(backend, query, kv_cache, kv_scales, out)
            breaks.append(cut)
            at_break(cut)
            return out

        # (attention reads only the K/V write's slots here: the rest is the break's to supply)
        metadata = _static_metadata(self.slot_mapping[:bucket])
        calibrating = [a for a in self.attentions if a.calibrate_kv]
        for attention in calibrating:  # (a captured forward must not measure: see can_run)
            attention.calibrate_kv = False
        for backend in self.backends:
            backend.graph_break = graph_break
        if self.lora is not None:
            assert self.static_lora is not None
            self.lora[0].batch = self.static_lora.batch(bucket) if with_lora else None
        try:
            hidden = self.model(
                self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata
            )
        finally:
            for backend in self.backends:
                backend.graph_break = None
            if self.lora is not None:
                self.lora[0].batch = None
            for module in calibrating:
                module.calibrate_kv = True
        return hidden, breaks

    def _capture(self, bucket: int, with_lora: bool) -> _Pieces:
        logger.info(
            "capturing CUDA graphs in pieces for steps of up to %d prompt tokens%s",
            bucket,
            " with LoRA" if with_lora else "",
        )
        # Warm up first, outside any capture: Triton compiles, cuBLAS picks its kernels. (One
        # prompt of `bucket` tokens, its K/V written into and read from the null block.)
        width = cdiv(bucket, self.kv_caches[0].shape[2])
        null = AttentionMetadata.one_prompt(
            torch.full((bucket,), NULL_BLOCK_ID, dtype=torch.int64, device=self.device),
            torch.full((width,), NULL_BLOCK_ID, dtype=torch.int32, device=self.device),
        )
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        graphs = [torch.cuda.CUDAGraph()]

        def attend_null(cut: _Break) -> None:
            cut.backend.attend(cut.q, cut.kv_cache, null, cut.kv_scales, cut.out)

        def next_piece(cut: _Break) -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool)

        with self.real_tokens.capturing(bucket):
            with torch.cuda.stream(stream):
                self._stage(self.input_ids[:bucket], self.positions[:bucket],
                            null.slot_mapping, bucket)  # fmt: skip
                self._forward_with_breaks(bucket, attend_null, with_lora)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.device)
            with torch.cuda.stream(stream), torch.inference_mode():
                graphs[0].capture_begin(pool=self.pool)
                try:
                    hidden, breaks = self._forward_with_breaks(bucket, next_piece, with_lora)
                finally:
                    graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return _Pieces(graphs, breaks, hidden)


def _attentions(model: LlamaForCausalLM) -> list[LlamaAttention]:
    return [layer.self_attn for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]


def _tp_size(model: LlamaForCausalLM) -> int:
    return 1 if model.tp is None else model.tp.world_size


def _static_metadata(slot_mapping: torch.Tensor) -> AttentionMetadata:
    n = slot_mapping.shape[0]
    empty = slot_mapping.new_zeros(1, dtype=torch.int32)
    return AttentionMetadata(slot_mapping, empty[None], empty, empty, n, n, [n], [n])
