#!/usr/bin/env bash
# Device call 27 (~2.5 min, right after call 26): the tiles bench/lora_layer.py favoured (shrink
# block_k 128: 1.49 against 1.61 ms of kernels alone; expand columns 256: 5.46 against 5.54 ms
# of projections whole), set in the working tree, against the committed tiles (.stage/base =
# `git archive HEAD`), two rounds, and the base engine once. (Result: no gain end to end; the
# tiles stayed at 64 / 128.)
set -uo pipefail
L="--model llama-3-8b --load-format dummy --batch-size 64 --input-len 512 --output-len 128"
timeout 90 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -p no:cacheprovider tests/gpu/test_lora_cuda.py -k "real_shapes or beside" 2>&1 | tail -1
timeout 300 bash bench/ab.sh .stage/base 2 "$OUT/lora" bench latency $L --num-loras 8 --lora-rank 16 --lora-share 1 >> "$OUT/log.txt" 2>&1
timeout 80 bench/device_env.sh python3 -m kvfleet.cli.main bench latency $L --json "$OUT/base.json" > "$OUT/base.txt" 2>&1
python3 bench/next/summary.py "$OUT"
