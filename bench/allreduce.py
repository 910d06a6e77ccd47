"""All-reduce latency between the GPUs of this machine, at the sizes tensor parallelism sends.

    bench/device_env.sh python3 bench/allreduce.py [--gpus 2]

One process per GPU. For each size (one decode token of Llama-3-70B, a batch of 256 decode
tokens of Llama-3-8B, an 8,192-token prefill step of Llama-3-8B; bf16), times NCCL's
all-reduce and the engine's peer-memory all-reduces (one-shot and two-shot,
engine/parallel/peer.py), issued
one by one and, at decode sizes, 160 of them captured in one CUDA graph (as a decode step of
80 layers replays them). Prints microseconds per all-reduce and NCCL's bus bandwidth, checks
the peer sums against NCCL's, then times leaving the process group. Then the all-reduce fused
with the residual add and RMSNorm after it (engine/parallel/triton_peer.py) against the peer
all-reduce followed by the norm kernel, at decode batches of a 70B and an 8B (hidden 8,192 and
4,096, 1 to 256 rows, each program count of the larger lane): equal bits, and microseconds per
pair in a CUDA graph; and the two-shot kernel of prefill steps (512 to 8,192 rows) against
NCCL's all-reduce then the norm.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from kvfleet.bench.ceilings import captured, median_seconds

if TYPE_CHECKING:
    from kvfleet.engine.parallel.peer import PeerAllReduce

SIZES = {
    "70b-decode-1": 8192,
    "8b-decode-32": 32 * 4096,
    "8b-decode-64": 64 * 4096,
    "8b-decode-128": 128 * 4096,
    "8b-decode-256": 256 * 4096,
    "8b-prefill-8192": 8192 * 4096,
}
OPS_PER_GRAPH = 160
HIDDEN = 8192  # (Llama-3-70B)


def _time_us(fn: Callable[[], object], count: int) -> float:
    """Microseconds per all-reduce when `fn` runs `count` of them."""
    return median_seconds(fn, torch.device("cuda")) * 1e6 / count


def _graph(fn: Callable[[], object], count: int) -> Callable[[], object]:
    return captured(lambda: [fn() for _ in range(count)])


def worker(rank: int, world: int, port: int, out: str) -> None:
    import gc
    import time

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", rank)
    results: dict[str, dict[str, float]] = {}
    peer = _peer(max(SIZES.values()), device)
    for name, numel in SIZES.items():
        x = torch.ones(numel, dtype=torch.bfloat16, device=device)
        row: dict[str, float] = {}
        row["nccl_eager_us"] = _time_us(lambda: dist.all_reduce(x), 1)  # noqa: B023
        if peer is not None:
            row["one_shot_eager_us"] = _time_us(lambda: peer(x, False), 1)  # noqa: B023
            row["two_shot_eager_us"] = _time_us(lambda: peer(x, True), 1)  # noqa: B023
        if numel <= 256 * 4096:
            replay = _graph(lambda: dist.all_reduce(x), OPS_PER_GRAPH)  # noqa: B023
            row["nccl_graph_us"] = _time_us(replay, OPS_PER_GRAPH)
            if peer is not None:
                for two_shot in (False, True):
                    replay = _graph(lambda: peer(x, two_shot), OPS_PER_GRAPH)  # noqa: B023
                    method = "two_shot" if two_shot else "one_shot"
                    row[f"{method}_graph_us"] = _time_us(replay, OPS_PER_GRAPH)
            del replay
        moved = 2 * (world - 1) / world * numel * 2  # bytes each GPU sends (ring)
        row["nccl_eager_bus_gb_s"] = moved / row["nccl_eager_us"] / 1e3
        results[name] = row
    # The sums agree with NCCL's bit for bit, on random values (each rank its own).
    if peer is not None:
        for numel in SIZES.values():
            values = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
            want = values.bfloat16()
            dist.all_reduce(want)
            for two_shot in (False, True):
                got = peer(values.bfloat16(), two_shot)
                key = f"{'two' if two_shot else 'one'}_shot_equal_{numel}"
                results[key] = {"ok": float(torch.equal(got, want))}
    if peer is not None:
        results.update(_fused_norm(rank, device))
        results.update(_two_shot_norm(device))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"gpus": world, **results}, f, indent=1)
    # Leaving: CUDA graphs holding NCCL kernels are freed first (teardown order under test).
    gc.collect()
    torch.cuda.synchronize()
    began = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: destroy_process_group {time.perf_counter() - began:.2f} s", flush=True)


def _fused_norm(rank: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Fused all-reduce + add + RMSNorm against the peer all-reduce (one- or two-shot by size)
    then `add_rms_norm`, at the hidden sizes of Llama-3-70B and 8B, for decode batches up to
    256 rows and each choice of programs for the larger lane: bits over 20 calls on random rows
    (each rank its own), then microseconds per call in a graph."""
    from kvfleet.engine.layers.triton_layers import add_rms_norm
    from kvfleet.engine.parallel.peer import PeerAllReduce

    group = dist.group.WORLD
    assert group is not None
    results: dict[str, dict[str, float]] = {}
    gen = torch.Generator(device).manual_seed(rank)
    for hidden in (HIDDEN, 4096):
        weight = torch.randn(hidden, device=device, generator=gen).bfloat16()
        for lanes in ((16, 256), (16, 128), (16, 64)):
            peer = PeerAllReduce(
                group.group_name, 256 * hidden, torch.bfloat16, device, hidden, lanes
            )
            for rows in (1, 16, 64, 128, 256) if lanes[1] == 256 else (64, 128, 256):
                row: dict[str, float] = {"programs": float(lanes[1] if rows > 16 else 16)}
                equal = True
                for _ in range(20):
                    x = torch.randn(rows, hidden, device=device, generator=gen).bfloat16()
                    residual = torch.randn(rows, hidden, device=device, generator=gen).bfloat16()
                    got = peer.add_rms_norm(x, residual, weight, 1e-5)
                    want = add_rms_norm(peer(x.clone()), residual, weight, 1e-5)
                    equal &= torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                row["equal"] = float(equal)
                replay = _graph(
                    lambda: peer.add_rms_norm(x, residual, weight, 1e-5),  # noqa: B023
                    OPS_PER_GRAPH,
                )
                row["fused_graph_us"] = _time_us(replay, OPS_PER_GRAPH)
                replay = _graph(
                    lambda: add_rms_norm(peer(x), residual, weight, 1e-5),  # noqa: B023
                    OPS_PER_GRAPH,
                )
                row["all_reduce_then_norm_graph_us"] = _time_us(replay, OPS_PER_GRAPH)
                del replay
                results[f"norm-{rows}x{hidden}-lanes{lanes[1]}"] = row
    return results


def _two_shot_norm(device: torch.device) -> dict[str, dict[str, float]]:
    """The two-shot all-reduce + add + RMSNorm of prefill steps against NCCL's all-reduce then
    `add_rms_norm`, at the hidden sizes of Llama-3-70B and 8B, 512 to 8,192 rows: bits over 5
    calls (residual and weight alike on every rank, as in a model), then microseconds per call
    issued 20 at a time."""
    from kvfleet.engine.layers.triton_layers import add_rms_norm
    from kvfleet.engine.parallel.peer import PeerAllReduce

    group = dist.group.WORLD
    assert group is not None
    results: dict[str, dict[str, float]] = {}
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    alike = torch.Generator(device).manual_seed(1234)
    calls = 20
    for hidden in (HIDDEN, 4096):
        peer = PeerAllReduce(
            group.group_name, 256 * hidden, torch.bfloat16, device, hidden, prefill_rows=8192
        )
        weight = torch.randn(hidden, device=device, generator=alike).bfloat16()

        def fused(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return peer.add_rms_norm(x, residual, weight, 1e-5)  # noqa: B023

        def unfused(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
            dist.all_reduce(x)
            return add_rms_norm(x, residual, weight, 1e-5)  # noqa: B023

        for rows in (512, 2048, 8192):
            equal = True
            for _ in range(5):
                x = torch.randn(rows, hidden, device=device, generator=gen).bfloat16()
                residual = torch.randn(rows, hidden, device=device, generator=alike).bfloat16()
                got, want = fused(x, residual), unfused(x.clone(), residual)
                equal &= torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            row = {"equal": float(equal)}
            for name, fn in (("two_shot_fused", fused), ("nccl_then_norm", unfused)):
                dist.barrier()
                row[f"{name}_us"] = _time_us(
                    lambda: [fn(x, residual) for _ in range(calls)],  # noqa: B023
                    calls,
                )
            results[f"two-shot-{rows}x{hidden}"] = row
    return results


def _peer(capacity: int, device: torch.device) -> PeerAllReduce | None:
    """The engine's peer-memory all-reduce (no fused norms), or None."""
    from kvfleet.engine.parallel.peer import PeerAllReduce

    group = dist.group.WORLD
    assert group is not None
    return PeerAllReduce.create(group.group_name, capacity, torch.bfloat16, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--out", default="allreduce.json")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # (multicast stays off)
    port = 29600 + os.getpid() % 1000
    spawn(worker, args=(args.gpus, port, args.out), nprocs=args.gpus)
    with open(args.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
