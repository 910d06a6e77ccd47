# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The vocabulary race (engine/sample/gumbel_race.py) alone on the GPU: a decode step's
sampling at R rows of Llama-3's vocabulary (128,256 float32 logits a row), greedy and at
temperature 1, timed inside a CUDA graph (the median replay) beside the logits' bytes at the
copy rate measured in the same run.

    bench/device_env.sh python3 bench/race.py [--rows 256 512]

(Session 38's FP8 1k/1k trace: 474.5 us a 512-row step at temperature 1, 232.9 at 256 rows.)
"""

from __future__ import annotations

import argparse

import torch

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.sample.gumbel_race import race, winners

VOCAB = 128256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    print(f"copy {copy / 1e9:.0f} GB/s")
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device=device) * 3
        keys = torch.arange(rows, device=device, dtype=torch.int64) + 7
        bases = torch.arange(rows, device=device, dtype=torch.int64) * VOCAB
        floor = logits.numel() * 4 / copy * 1e6
        for temperature in (0.0, 1.0):
            temperatures = torch.full((rows,), temperature, dtype=torch.float64, device=device)
            drawn = winners(race(logits, temperatures, keys, bases))
            if temperature == 0.0:
                assert torch.equal(drawn, logits.argmax(-1)), "greedy rows: argmax"
            step = captured(lambda: race(logits, temperatures, keys, bases))
            us = median_seconds(step, device, repeats=20) * 1e6
            print(f"rows {rows:4d} T={temperature}: {us:7.1f} us (bytes floor {floor:5.1f})",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
