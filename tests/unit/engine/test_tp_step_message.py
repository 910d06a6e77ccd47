"""The per-step broadcast of tensor parallelism (engine/parallel/group.py, step_message.py)
between two real processes over gloo: what rank 1 receives equals what rank 0 packed, for a
step whose lengths fit the one host message and for one with more sequences than it carries
(the rest follows in a second message), and the stop signal ends the exchange."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from kvfleet.engine.loader.source import resolve_model_source
from kvfleet.engine.parallel.group import TPGroup
from kvfleet.engine.parallel.partition import TPPlan
from kvfleet.engine.parallel.step_message import ALIGN_BYTES, INLINE_SEQS, PackedStep, pack_aligned
from kvfleet.engine.worker.process import free_port

SEQS = (3, INLINE_SEQS, INLINE_SEQS + 45)
# (any model splits over two ranks; the plan only names this rank's shards)
CONFIG = resolve_model_source("llama-3-8b", "dummy").read_config()


def _step(num_seqs: int) -> PackedStep:
    """A step of `num_seqs` sequences, a third of them decodes (first, long enough to be
    split off when there are many), the rest two tokens each, every value distinct."""
    gen = torch.Generator().manual_seed(num_seqs)
    query_lens = [1] * (num_seqs // 3) + [2] * (num_seqs - num_seqs // 3)
    n, max_blocks = sum(query_lens), 3
    num_longs, num_ints = PackedStep.sizes(n, num_seqs, max_blocks, num_seqs, race=False)
    longs = torch.randint(0, 1 << 40, (num_longs,), generator=gen)
    ints = torch.randint(0, 1 << 30, (num_ints,), generator=gen).int()
    seq_lens = torch.randint(400, 1000, (num_seqs,), generator=gen).tolist()
    return PackedStep(longs, ints, n, num_seqs, max_blocks, num_seqs, query_lens, seq_lens)


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TPGroup(TPPlan.build(CONFIG, rank, 2), torch.device("cpu"), dist.group.WORLD)
    for num_seqs in SEQS:
        sent = _step(num_seqs)
        if rank == 0:
            tp.broadcast_step(sent)
            continue
        got = tp.receive_step()
        want = sent.unpack()
        assert got is not None
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.positions, want.positions)
        assert torch.equal(got.logits_indices, want.logits_indices)
        for field in ("slot_mapping", "block_tables", "cu_seqlens_q", "seq_lens"):
            assert torch.equal(getattr(got.metadata, field), getattr(want.metadata, field))
        assert got.metadata.query_lens_cpu == sent.query_lens_cpu
        assert got.metadata.seq_lens_cpu == sent.seq_lens_cpu
        assert got.metadata.max_seqlen_k == max(sent.seq_lens_cpu)
        split = num_seqs // 3 if num_seqs > 3 else 0  # (one decode's KV: below the minimum)
        assert got.metadata.num_decodes == want.metadata.num_decodes == split
    if rank == 0:
        tp.broadcast_stop()
    else:
        assert tp.receive_step() is None
    tp.close()


@pytest.mark.parametrize(
    ("num_tokens", "num_seqs", "race"), [(1, 1, True), (7, 3, True), (64, 5, False)]
)
def test_every_part_of_a_packed_step_is_aligned_and_read_back(
    num_tokens: int, num_seqs: int, race: bool
) -> None:
    """Each part starts on a 16-byte boundary whatever the sizes (Triton specializes kernels on
    their pointers' alignment), and `unpack` reads back what was packed."""
    max_blocks, num_sampled = 3, num_seqs
    parts = [np.arange(num_tokens) + 100 * k for k in range(3)]
    parts.append(np.arange(num_sampled) + 300)
    if race:
        parts += [np.arange(num_sampled) + 400 + 100 * k for k in range(3)]
    ints = [np.arange(num_seqs * max_blocks), np.arange(num_seqs + 1) + 50, np.arange(num_seqs)]
    longs, ints_packed = pack_aligned(parts, np.int64), pack_aligned(ints, np.int32)
    sizes = PackedStep.sizes(num_tokens, num_seqs, max_blocks, num_sampled, race)
    assert (len(longs), len(ints_packed)) == sizes
    step = PackedStep(
        torch.from_numpy(longs),
        torch.from_numpy(ints_packed),
        num_tokens,
        num_seqs,
        max_blocks,
        num_sampled,
        [1] * num_seqs,
        [9] * num_seqs,
        race,
    ).unpack()
    read = [step.input_ids, step.positions, step.metadata.slot_mapping, step.logits_indices]
    if race:
        assert step.race is not None
        temperature = step.race.temperature.view(torch.int64)
        read += [step.race.keys, step.race.bases, temperature]
    meta = step.metadata
    for got, want in zip(
        [*read, meta.block_tables.ravel(), meta.cu_seqlens_q, meta.seq_lens],
        [*parts, *ints],
        strict=True,
    ):
        assert got.tolist() == want.tolist()
        assert got.data_ptr() % ALIGN_BYTES == 0


@pytest.mark.timeout(120)
def test_every_step_arrives_whole_and_the_stop_ends_it() -> None:
    spawn(_rank, args=(free_port(),), nprocs=2)
