#!/usr/bin/env bash
# Device call 9 (gpu-next8): the 4-bit one-row GEMV's tiles by layer size (Llama-3-8B's gate_up
# and down on 32-wide blocks of 4 steps, 2 warps) against main: INT4 batch 1 (two rounds, trees
# alternating), the layer chain on both trees, the 4-bit GPU tests.
set -uo pipefail
OUT=${OUT:?}
timeout 250 bash bench/ab.sh .stage/base 2 "$OUT/b1-int4" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 1 --quantization rtn > "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
for tree in before after; do
  echo "== chain, $tree"
  PYTHONPATH=/tmp/src-$tree:/tmp/site timeout 60 python3 bench/gemv_chain.py 2>&1 | grep int4
done
timeout 150 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_int4_cuda.py > "$OUT/tests.txt" 2>&1; tail -2 "$OUT/tests.txt"
