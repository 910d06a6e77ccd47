"""The decode kernel over many layers' caches, as a serving step runs it, beside the same layer
timed again and again (`attention_steps.py --part tiles`, whose caches stay warm in the TLBs):
how the blocks' placement in the pool and the pool's size change a layer's time.

    bench/device_env.sh python3 bench/decode_layers.py --steps 512:1500:1510 \\
        --placement shuffled engine contiguous [--layers 32] [--pool-blocks 115000] [--cache fp8]

Placements of a sequence's blocks: `shuffled` (anywhere in the pool, as attention_steps.py
places them), `engine` (as the engine's FIFO free list hands them out to a 1k/1k run: each
prompt's blocks in one run, then one block a sequence in turn every 16 decode steps), and
`contiguous` (all of a sequence's blocks in one run). `--e4m3`: each also through the FP8
cache's e4m3-products kernel (`--e4m3-tiles`: at these tiles too). Figures: microseconds a
layer, median of replays of one CUDA graph of `--layers` calls; the floor is the KV bytes at
the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch

from kvfleet.bench.attention_steps import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    _step,
    graph_us,
    kv_bytes,
)
from kvfleet.bench.ceilings import measure_ceilings
from kvfleet.engine.attention import triton_decode, triton_decode_e4m3
from kvfleet.engine.attention.metadata import AttentionMetadata


def block_tables(
    seq_lens: list[int], placement: str, pool: int, prompt_len: int, seed: int = 0
) -> torch.Tensor:
    """[seqs, max blocks] int32 of blocks 1.. of a pool of `pool` blocks, by `placement`."""
    counts = [-(-n // BLOCK) for n in seq_lens]
    need = sum(counts)
    assert pool > need, f"the pool holds {pool} blocks, the step needs {need} + the null block"
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    if placement == "shuffled":
        order = torch.randperm(pool - 1, generator=torch.Generator().manual_seed(seed)) + 1
        taken = 0
        for row, count in enumerate(counts):
            tables[row, :count] = order[taken : taken + count]
            taken += count
    elif placement == "contiguous":
        taken = 1
        for row, count in enumerate(counts):
            tables[row, :count] = torch.arange(taken, taken + count)
            taken += count
    else:  # engine: prompts' runs first, then decode blocks handed out in turn
        prompt_blocks = -(-prompt_len // BLOCK)
        taken = 1
        for row, count in enumerate(counts):
            first = min(prompt_blocks, count)
            tables[row, :first] = torch.arange(taken, taken + first)
            taken += first
        for column in range(prompt_blocks, max(counts)):
            for row, count in enumerate(counts):
                if column < count:
                    tables[row, column] = taken
                    taken += 1
    return tables


def _tile(text: str) -> tuple[int, int, int]:
    """BLOCK_N,WARPS,STAGES (argparse reports a bad one)."""
    block_n, warps, stages = (int(value) for value in text.split(","))
    return block_n, warps, stages


def random_cache(pool: int, fp8: bool) -> torch.Tensor:
    """A layer's cache [2, pool, BLOCK, KV_HEADS, HEAD_DIM] of small finite values."""
    shape = (2, pool, BLOCK, KV_HEADS, HEAD_DIM)
    if fp8:  # (random bytes of magnitude 2^-4..2^0 and either sign: no NaN patterns)
        raw = torch.randint(0x28, 0x40, shape, dtype=torch.uint8, device="cuda")
        raw |= torch.randint(0, 2, shape, dtype=torch.uint8, device="cuda") << 7
        return raw.view(torch.float8_e4m3fn)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def layer_gemms(rows: int) -> Callable[[], object]:
    """A Llama-3-8B layer's four FP8 GEMMs at `rows` rows (qkv, o, gate_up, down through
    cuBLASLt with row and column scales), as a decode step runs them between attentions."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    mats = []
    for n, k in shapes:
        x = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 0.1).to(torch.float8_e4m3fn)
        mats.append((x, w, torch.ones(rows, 1, device="cuda"), torch.ones(1, n, device="cuda")))

    def run() -> None:
        for x, w, x_scale, w_scale in mats:
            torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)

    return run


def layer_times(
    lens: list[int], caches: list[torch.Tensor], placement: str, prompt_len: int, gemms: bool
) -> tuple[float, float]:
    """(us of one layer's call timed again and again, us a call over every layer in turn;
    with `gemms`, each call after a layer's four FP8 GEMMs, their own time taken out)."""
    num_seqs, pool = len(lens), caches[0].shape[1]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device="cuda"),
        block_tables=block_tables(lens, placement, pool, prompt_len).cuda(),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        max_seqlen_q=1,
        max_seqlen_k=lens[0],
        query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=lens,
    )
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    call = functools.partial(
        triton_decode.decode_attention, q, out=torch.empty_like(q), metadata=metadata,
        scale=0.088, kv_scales=torch.ones(2, device="cuda"),
    )  # fmt: skip
    before = layer_gemms(num_seqs) if gemms else (lambda: None)
    alone = graph_us(before, replays=len(caches)) if gemms else 0.0
    same = graph_us(lambda: (before(), call(kv_cache=caches[0])), replays=len(caches))
    turn = itertools.count()  # (each layer's cache in turn)
    spread = graph_us(
        lambda: (before(), call(kv_cache=caches[next(turn) % len(caches)])), len(caches)
    )
    if gemms:
        print(f"  the four FP8 GEMMs of a layer at {num_seqs} rows alone: {alone:.1f} us")
    return same - alone, spread - alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", nargs="+", type=_step, default=[(512, 1500, 1510)])
    parser.add_argument("--placement", nargs="+", default=["shuffled", "engine", "contiguous"],
                        choices=("shuffled", "engine", "contiguous"))  # fmt: skip
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--pool-blocks",
        type=int,
        nargs="*",
        default=[0],
        help="blocks a layer's pool holds (0: just what the step needs)",
    )
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument(
        "--e4m3",
        action="store_true",
        help="each also through the e4m3-products kernel (triton_decode_e4m3)",
    )
    parser.add_argument(
        "--e4m3-tiles",
        type=_tile,
        nargs="*",
        default=[],
        help="BLOCK_N,WARPS,STAGES tiles of the e4m3 kernel tried beside its shipped one",
    )
    parser.add_argument(
        "--gemms",
        action="store_true",
        help="each call after a layer's FP8 GEMMs (their time taken out)",
    )
    args = parser.parse_args()
    fp8 = args.cache == "fp8"
    copy_gbps = measure_ceilings(torch.device("cuda"), torch.bfloat16).copy_gbps
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s")
    gen = torch.Generator().manual_seed(2)
    shipped = triton_decode_e4m3.E4M3_TILE
    e4m3_tiles = [shipped, *args.e4m3_tiles] if args.e4m3 or args.e4m3_tiles else []
    for num_seqs, shortest, longest in args.steps:
        drawn = torch.randint(shortest, longest + 1, (num_seqs,), generator=gen)
        lens = sorted(drawn.tolist(), reverse=True)
        need = sum(-(-n // BLOCK) for n in lens) + 1
        floor_us = kv_bytes(lens, fp8) / (copy_gbps * 1e3)
        for asked in args.pool_blocks:
            pool = max(asked, need)
            caches = [random_cache(pool, fp8) for _ in range(args.layers)]
            kernels = [None, *e4m3_tiles]  # (None: the upcasting kernel)
            for placement, tile in itertools.product(args.placement, kernels):
                triton_decode.E4M3_PRODUCTS = tile is not None
                triton_decode_e4m3.E4M3_TILE = tile or shipped
                same, spread = layer_times(lens, caches, placement, args.prompt_len, args.gemms)
                print(
                    f"{num_seqs} x [{shortest}, {longest}] pool {pool} blocks {placement:10s}"
                    f"{f' e4m3 products {tile}' if tile else ''}: "
                    f"one layer again {same:6.1f} us ({floor_us / same:5.1%}), "
                    f"{args.layers} layers {spread:6.1f} us ({floor_us / spread:5.1%} of floor "
                    f"{floor_us:.1f} us)"
                )
            caches.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
