#!/usr/bin/env bash
# Device call 2: the 4-bit one-row GEMV with subnormal unpacking against main's: batch-1 INT4
# decode (trees alternating), the layer chain on both trees (the same script, each tree's
# package first on the path as bench/ab.sh links them), the kernel's tile sweep, its GPU tests.
set -uo pipefail
OUT=${OUT:?}
timeout 150 bash bench/ab.sh .stage/base 1 "$OUT/b1-int4" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 1 --quantization rtn > "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
for tree in before after; do
  echo "== chain, $tree"
  PYTHONPATH=/tmp/src-$tree:/tmp/site timeout 60 python3 bench/gemv_chain.py 2>&1 | tail -3
done
timeout 100 bench/device_env.sh python3 bench/int4_gemm.py --rows 1 > "$OUT/int4_gemv.txt" 2>&1
grep "M=" "$OUT/int4_gemv.txt" | cut -c1-700
timeout 150 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_int4_cuda.py > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt"
