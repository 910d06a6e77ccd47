"""The fused all-reduce + residual add + RMSNorm (engine/parallel/triton_peer.py) on 2 GPUs:
bit-equal to NCCL's all-reduce followed by `add_rms_norm`, called eagerly with varying row
counts in each lane (up to 16, 64 and 160 rows), then replayed from a CUDA graph of 160 calls
(as a decode step of 80 layers runs them; three chains of 8, 48 and 150 rows, one per lane,
taking turns) many times over, where a slip in the flags or the halves would show as a wrong
sum; and the two-shot kernel of prefill steps (161 to 2,048 rows) against the same."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

HIDDEN = 1024
PREFILL = 2048  # rows of the two-shot lane


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from kvfleet.engine.layers.triton_layers import add_rms_norm
    from kvfleet.engine.parallel.peer import PeerAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = dist.group.WORLD
    assert group is not None
    peer = PeerAllReduce.create(
        group.group_name, 160 * HIDDEN, torch.bfloat16, device, HIDDEN, prefill_rows=PREFILL
    )
    assert peer is not None
    assert peer.norm_rows == PREFILL
    assert peer.two_shot is not None
    lanes = [(lane.programs, lane.max_rows) for lane in peer.lanes]
    assert lanes == [(16, 16), (64, 64), (128, 160)]
    gen = torch.Generator(device).manual_seed(rank)
    weight = torch.randn(HIDDEN, device=device, generator=gen).bfloat16()

    def unfused(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        summed = x.clone()
        dist.all_reduce(summed)
        return add_rms_norm(summed, residual, weight, 1e-5)

    for step in range(50):
        rows = (1, 3, 16, 9, 17, 64, 40, 160, 130, 65)[step % 10]
        x = torch.randn(rows, HIDDEN, device=device, generator=gen).bfloat16()
        residual = None if step % 5 == 0 else torch.randn_like(x)
        got, want = peer.add_rms_norm(x, residual, weight, 1e-5), unfused(x, residual)
        assert torch.equal(got[0], want[0]), f"rank {rank} step {step}: normed"
        assert torch.equal(got[1], want[1]), f"rank {rank} step {step}: residual"

    # A graph of 160 calls in three chains (one per lane) taking turns, replayed with fresh
    # inputs: each output of a chain feeds its next call.
    inputs = [
        torch.empty(rows, HIDDEN, device=device, dtype=torch.bfloat16) for rows in (8, 48, 150)
    ]
    residuals = [torch.empty_like(x) for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, residual in zip(inputs, residuals, strict=True):
            peer.add_rms_norm(x, residual, weight, 1e-5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chains = list(zip(inputs, residuals, strict=True))
        for call in range(160):
            chains[call % 3] = peer.add_rms_norm(*chains[call % 3], weight, 1e-5)
    for replay in range(20):
        wants = []
        for x, residual in zip(inputs, residuals, strict=True):
            x.copy_(torch.randn(x.shape, device=device, generator=gen))
            residual.copy_(torch.randn(x.shape, device=device, generator=gen))
            wants.append((x.clone(), residual.clone()))
        graph.replay()
        for call in range(160):
            wants[call % 3] = unfused(*wants[call % 3])
        for (hidden, res), (want_hidden, want_res) in zip(chains, wants, strict=True):
            assert torch.equal(hidden, want_hidden), f"rank {rank} replay {replay}"
            assert torch.equal(res, want_res), f"rank {rank} replay {replay}"
    # Prefill steps: the two-shot kernel, with the residual and weight alike on every rank.
    alike = torch.Generator(device).manual_seed(1234)
    weight = torch.randn(HIDDEN, device=device, generator=alike).bfloat16()
    for step in range(24):
        rows = (161, 300, 264, 529, 1000, PREFILL)[step % 6]
        x = torch.randn(rows, HIDDEN, device=device, generator=gen).bfloat16()
        residual = None if step % 5 == 0 else torch.randn_like(x, generator=alike)
        got, want = peer.add_rms_norm(x, residual, weight, 1e-5), unfused(x, residual)
        assert torch.equal(got[0], want[0]), f"rank {rank} prefill step {step}: normed"
        assert torch.equal(got[1], want[1]), f"rank {rank} prefill step {step}: residual"
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def test_fused_all_reduce_norm_equals_nccl_then_norm_eager_and_in_graphs() -> None:
    from torch.multiprocessing.spawn import spawn

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    spawn(_worker, args=(2, 29500 + os.getpid() % 500), nprocs=2)
