#!/usr/bin/env bash
# Device call 26 (~8 min): call 24 left LoRA at batch 64 where it was (7.83-7.96 ms a step on
# both trees; the 256 LoRA kernels 1.58 ms of it, ~6 us each at ~1 us of bytes). Now the shrink
# runs on a side stream beside the base matmul. GPU tests (the side stream's join
# mutation-checked: with it removed the new test must fail), the projections whole
# (bench/lora_layer.py: base alone, shrink in line, beside, the expand's tile swept), then batch
# 64 with 8 adapters against main (two rounds) and the base engine once, for the ratio.
set -uo pipefail
OUT=${OUT:?}
T="-o addopts=--import-mode=importlib -q -p no:cacheprovider"
timeout 150 bench/device_env.sh python3 -m pytest $T tests/gpu/test_lora_cuda.py \
  > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -6
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r cli engine gateway operator bench tests .whl /tmp/mut/
sed -i '/main.wait_stream(side)/d' /tmp/mut/engine/lora/layers.py
(cd /tmp/mut && timeout 90 bench/device_env.sh python3 -m pytest $T \
  tests/gpu/test_lora_cuda.py -k beside 2>&1 | tail -2 | sed 's/^/mutant (join removed): /')
echo "kernels and projections whole:"
timeout 150 bench/device_env.sh python3 bench/lora_layer.py 2>&1 | tail -12
L="--model llama-3-8b --load-format dummy --batch-size 64 --input-len 512 --output-len 128"
timeout 200 bash bench/ab.sh .stage/base 2 "$OUT/lora" bench latency $L --num-loras 8 \
  --lora-rank 16 --lora-share 1 >> "$OUT/log.txt" 2>&1
timeout 80 bench/device_env.sh python3 -m kvfleet.cli.main bench latency $L \
  --json "$OUT/base.json" > "$OUT/base.txt" 2>&1
echo "base engine:"; grep -E '"(decode_ms_per_token|pct_of_floor|output_tok_per_s|ttft_ms)"' "$OUT/base.txt"
python3 bench/next/summary.py "$OUT"
