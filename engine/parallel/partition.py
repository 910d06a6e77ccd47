"""Which slice of each weight a tensor-parallel rank holds (pure; no torch.distributed here).

Attention is split by whole GQA groups: a rank holds some KV heads and exactly the query heads
that read them, so attention needs no communication. With fewer KV heads than ranks, each KV
head is replicated on `world_size / num_kv_heads` ranks that share its query heads. Uneven splits
are allowed (SmolLM2's 3 KV heads over 2 ranks: 2 + 1). The MLP's intermediate dimension, each
expert's (every rank holds every expert of a mixture, a slice of each) and the vocabulary are
split as evenly as possible; vocabulary shards are padded to one size so logits can be
all-gathered.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from kvfleet.engine.config import ModelConfig

# (dimension, start, length) of a checkpoint tensor that one rank keeps
Slice = tuple[int, int, int]


@dataclass(frozen=True)
class Span:
    start: int
    size: int


def even_span(total: int, rank: int, world_size: int) -> Span:
    """Rank `rank`'s part of `total` items split into `world_size` contiguous parts whose sizes
    differ by at most one (the first parts are the larger)."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return Span(start, base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class TPPlan:
    rank: int
    world_size: int
    head_dim: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    expert_intermediate: Span  # of every expert (a mixture of experts)
    vocab: Span
    vocab_per_rank: int  # every rank's (padded) vocabulary rows

    @classmethod
    def build(cls, config: ModelConfig, rank: int, world_size: int) -> TPPlan:
        """ValueError when the model's shapes cannot be split over `world_size` ranks."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        group = heads // kv  # query heads per KV head
        if kv >= world_size:
            kv_span = even_span(kv, rank, world_size)
            q_span = Span(kv_span.start * group, kv_span.size * group)
        else:
            if world_size % kv:
                raise ValueError(
                    f"tensor parallel size {world_size} must be a multiple of the model's "
                    f"{kv} KV heads when it exceeds them"
                )
            replicas = world_size // kv
            if group % replicas:
                raise ValueError(
                    f"{group} query heads per KV head cannot be split over {replicas} ranks"
                )
            kv_span = Span(rank // replicas, 1)
            per_rank = group // replicas
            q_span = Span(kv_span.start * group + (rank % replicas) * per_rank, per_rank)
        if config.intermediate_size < world_size:
            raise ValueError(f"the MLP cannot be split over {world_size} ranks")
        if config.moe_layers and config.moe_intermediate_size < world_size:
            raise ValueError(
                f"the experts' inner dimension ({config.moe_intermediate_size}) cannot be split "
                f"over {world_size} ranks"
            )
        vocab_per_rank = -(-config.vocab_size // world_size)
        start = min(rank * vocab_per_rank, config.vocab_size)
        vocab = Span(start, min(vocab_per_rank, config.vocab_size - start))
        return cls(
            rank=rank,
            world_size=world_size,
            head_dim=config.head_dim,
            q_heads=q_span,
            kv_heads=kv_span,
            intermediate=even_span(config.intermediate_size, rank, world_size),
            expert_intermediate=even_span(config.moe_intermediate_size, rank, world_size),
            vocab=vocab,
            vocab_per_rank=vocab_per_rank,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's layers are built with."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.q_heads.size,
            num_key_value_heads=self.kv_heads.size,
            intermediate_size=self.intermediate.size,
            moe_intermediate_size=self.expert_intermediate.size,
        )

    def slice_for(
        self,
        hf_name: str,
        block: tuple[int, int] | None = None,
        packed: tuple[str, int, int] | None = None,
    ) -> Slice | None:
        """The part of a checkpoint tensor this rank keeps; None: all of it (replicated).
        FP8 weight scales follow their weight: per-channel ones ([out, 1]) along its output
        rows, block ones (`block` = (rows, cols) per scale) along either dimension, in blocks.
        AWQ / GPTQ tensors (`packed` = the checkpoint's (source, group size, bits)) follow their
        weight in their own layout: input rows first, packed 32 / bits to a word along one
        dimension (_PACKED_DIMS)."""
        for suffix in (".weight_scale", ".weight_scale_inv"):
            if hf_name.endswith(suffix):
                return self._scale_slice(hf_name.removesuffix(suffix) + ".weight", block)
        module, _, kind = hf_name.rpartition(".")
        if packed is not None and kind in ("qweight", "qzeros", "scales", "g_idx"):
            return self._packed_slice(module, kind, *packed)
        hd = self.head_dim
        q = (self.q_heads.start * hd, self.q_heads.size * hd)
        kv = (self.kv_heads.start * hd, self.kv_heads.size * hd)
        inter = (self.intermediate.start, self.intermediate.size)
        expert = (self.expert_intermediate.start, self.expert_intermediate.size)
        vocab = (self.vocab.start, self.vocab.size)
        rules: tuple[tuple[str, int, tuple[int, int]], ...] = (
            (r"\.experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight$", 0, expert),
            (r"\.experts\.\d+\.(w2|down_proj)\.weight$", 1, expert),
            (r"\.q_proj\.(weight|bias)$", 0, q),
            (r"\.[kv]_proj\.(weight|bias)$", 0, kv),
            (r"\.o_proj\.weight$", 1, q),
            (r"\.(gate|up)_proj\.(weight|bias)$", 0, inter),
            (r"\.down_proj\.weight$", 1, inter),
            (r"(^|\.)(embed_tokens|lm_head)\.weight$", 0, vocab),
        )
        for pattern, dim, (start, length) in rules:
            if re.search(pattern, hf_name):
                return dim, start, length
        return None

    def _packed_slice(
        self, module: str, kind: str, source: str, group: int, bits: int
    ) -> Slice | None:
        part = self.slice_for(module + ".weight")
        if part is None:
            return None
        dim, start, length = part
        place = _PACKED_DIMS[(source if kind == "qweight" else "any", kind)][dim]
        if place is None:
            return None
        tensor_dim, along = place
        if along == "group" and group == -1:  # (one group of all the inputs: GPTQ's -1)
            return None
        unit = {"packed": 32 // bits, "group": group, "each": 1}[along]
        if start % unit or length % unit:
            raise ValueError(
                f"{module}.{kind}: this rank's {'outputs' if dim == 0 else 'inputs'} "
                f"{start}..{start + length} do not fall on the checkpoint's units of {unit} "
                f"({'packed words' if along == 'packed' else 'quantization groups'}); choose a "
                "tensor parallel size that splits the layers on them"
            )
        return tensor_dim, start // unit, length // unit

    def _scale_slice(self, weight: str, block: tuple[int, int] | None) -> Slice | None:
        part = self.slice_for(weight)
        if part is None:
            return None
        dim, start, length = part
        if block is None:  # (one scale per output row; a row-parallel layer keeps them all)
            return part if dim == 0 else None
        unit = block[dim]
        if start % unit or length % unit:
            raise ValueError(
                f"{weight}: rows {start}..{start + length} of this rank do not fall on the "
                f"checkpoint's {block[0]}x{block[1]} scale blocks; choose a tensor parallel "
                "size that splits the layers on block boundaries"
            )
        return dim, start // unit, length // unit


# Where an INT4 tensor holds its weight's outputs and inputs: (tensor dim, unit) per weight dim
# (0: outputs, 1: inputs); units "packed" (32 / bits values to a word), "group" (the
# quantization group) or "each"; None: not split (whole on every rank). GPTQ's qweight is
# [K / P, N], AWQ's [K, N / 8]; both qzeros [K / g, N / P], scales [K / g, N], g_idx [K].
_Place = tuple[int, Literal["packed", "group", "each"]] | None
_PACKED_DIMS: dict[tuple[str, str], tuple[_Place, _Place]] = {
    ("gptq", "qweight"): ((1, "each"), (0, "packed")),
    ("awq", "qweight"): ((1, "packed"), (0, "each")),
    ("any", "qzeros"): ((1, "packed"), (0, "group")),
    ("any", "scales"): ((1, "each"), (0, "group")),
    ("any", "g_idx"): (None, (0, "each")),
}
