#!/usr/bin/env bash
# Device call 119 (session 46): call 118's traces put Llama-3.2-1B's WIDE_BF16 loss on the host
# (GPU path faster with it: graph replay 0.727 against 0.766 ms; every host call ~1.5x slower in
# the run with it on, which ran first in each pair). The same A/B in the other order, three
# rounds: off first.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant narrow engine/layers/triton_gemv.py '!WIDE_BF16'
batch1_variants 3 llama-3.2-1b narrow=/tmp/var/narrow base=.stage/base
nproc; python3 bench/next/summary.py "$OUT"
