#!/usr/bin/env bash
# Device call 6 (session 29): the decode kernel unsplit from 3 programs an SM, with the
# subnormal 4-bit GEMV, against main: batch 64 bf16 (two rounds), batch 64 FP8 + FP8 KV, batch
# 1 bf16 (unchanged plan), INT4 batch 1 beside bf16 batch 1 of this tree; the decode GPU tests.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 200 bash bench/ab.sh .stage/base 2 "$OUT/b64" bench latency $L --batch-size 64 > "$OUT/log.txt" 2>&1
timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b64-fp8" bench latency $L --batch-size 64 \
  --quantization fp8 --kv-cache-dtype fp8 >> "$OUT/log.txt" 2>&1
timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b1" bench latency $L --batch-size 1 >> "$OUT/log.txt" 2>&1
mkdir -p "$OUT/b1-int4"; timeout 60 bench/device_env.sh python3 -m kvfleet.cli.main bench latency $L --batch-size 1 \
  --quantization rtn --json "$OUT/b1-int4/after-1.json" >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_triton_cuda.py -k "decode_kernel or graph" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"; tail -5 "$OUT/log.txt" | cut -c1-200
