"""How much of a prefill step's all-reduces can hide behind its matmuls (tensor parallelism).

    bench/device_env.sh python3 bench/prefill_overlap.py [--gpus 2] [--tokens 8192]
        [--high-priority]

One process per GPU, Llama-3-8B's layer at TP=2 (bf16). For each row-parallel layer (the
attention output and MLP down projections), device microseconds of: the matmul alone; the
matmul then NCCL's all-reduce (what the engine does now); the matmul in row chunks, each
chunk's all-reduce queued on NCCL's stream while the next chunk multiplies; and PyTorch's
symmetric-memory `fused_matmul_reduce_scatter` (copy-engine transfers) with the all-gather
that sequence parallelism would pair it with. For the column-parallel layers (QKV, gate/up):
the matmul over all tokens against `fused_all_gather_matmul` over this rank's half.
Results (and whether the overlapped sums equal the serial ones) to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from kvfleet.bench.ceilings import median_seconds

# (name, in_features per rank, out_features): Llama-3-8B at TP=2
ROW_PARALLEL = [("o_proj", 2048, 4096), ("down_proj", 7168, 4096)]
COLUMN_PARALLEL = [("qkv_proj", 4096, 3072), ("gate_up_proj", 4096, 7168 * 2)]
CHUNKS = (2, 4, 8)


def _us(fn: Callable[[], object]) -> float:
    return median_seconds(fn, torch.device("cuda"), repeats=20) * 1e6


def chunked(x: torch.Tensor, weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """x @ weight.T summed over ranks, each row chunk's all-reduce overlapping the next
    chunk's matmul."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    works = []
    for rows_x, rows_out in zip(x.chunk(chunks), out.chunk(chunks), strict=True):
        torch.mm(rows_x, weight.t(), out=rows_out)
        works.append(dist.all_reduce(rows_out, async_op=True))
    for work in works:
        work.wait()
    return out


def serial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = x @ weight.t()
    dist.all_reduce(out)
    return out


def worker(
    rank: int, world: int, port: int, tokens: int, out_path: str, high_priority: bool
) -> None:
    import torch.distributed._symmetric_memory  # (registers the symm_mem ops)

    torch.cuda.set_device(rank)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high_priority
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        pg_options=options,
    )
    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    device = torch.device("cuda", rank)
    gen = torch.Generator(device).manual_seed(rank)
    results: dict[str, dict[str, float]] = {}
    for label, k, n in ROW_PARALLEL:
        x = torch.randn(tokens, k, device=device, generator=gen).bfloat16()
        weight = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
        want = serial(x, weight)
        row = {
            "matmul_us": _us(lambda: x @ weight.t()),  # noqa: B023
            "all_reduce_us": _us(lambda: dist.all_reduce(want)),  # noqa: B023
            "serial_us": _us(lambda: serial(x, weight)),  # noqa: B023
        }
        want = serial(x, weight)
        for chunks in CHUNKS:
            row[f"chunked{chunks}_us"] = _us(lambda: chunked(x, weight, chunks))  # noqa: B023
            row[f"chunked{chunks}_equal"] = float(torch.equal(chunked(x, weight, chunks), want))
        shard = torch.empty(tokens, n, dtype=x.dtype, device=device)

        def scatter_gather() -> torch.Tensor:
            part = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                x,  # noqa: B023
                weight.t(),  # noqa: B023
                "sum",
                0,
                name,
            )
            dist.all_gather_into_tensor(shard, part)  # noqa: B023
            return shard  # noqa: B023

        row["fused_rs_then_ag_us"] = _us(scatter_gather)
        half = tokens // world
        row["fused_rs_us"] = _us(
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                x,  # noqa: B023
                weight.t(),  # noqa: B023
                "sum",
                0,
                name,
            )
        )
        got = scatter_gather()
        row["fused_rs_max_diff"] = float((got.float() - want.float()).abs().max())
        row["ag_us"] = _us(
            lambda: dist.all_gather_into_tensor(shard, shard[rank * half : (rank + 1) * half])  # noqa: B023
        )
        results[label] = row
    for label, k, n in COLUMN_PARALLEL:
        x = torch.randn(tokens, k, device=device, generator=gen).bfloat16()
        weight = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
        half = tokens // world
        mine = x[rank * half : (rank + 1) * half].contiguous()
        row = {"matmul_us": _us(lambda: x @ weight.t())}  # noqa: B023
        row["fused_ag_matmul_us"] = _us(
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                mine,  # noqa: B023
                [weight.t()],  # noqa: B023
                0,
                name,
                return_A=False,
            )
        )
        results[label] = row
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {"gpus": world, "tokens": tokens, "high_priority": high_priority, **results},
                f,
                indent=1,
            )
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default="/tmp/prefill_overlap.json")
    parser.add_argument(
        "--high-priority", action="store_true", help="NCCL on high-priority streams"
    )
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    port = 29700 + os.getpid() % 1000
    spawn(
        worker,
        args=(args.gpus, port, args.tokens, args.out, args.high_priority),
        nprocs=args.gpus,
    )
    with open(args.out) as f:
        print(f.read())


if __name__ == "__main__":
    main()
