#!/usr/bin/env bash
# Device call 67: the FP8 cache's e4m3-products decode kernel (triton_decode_e4m3): its GPU
# tests beside the FP8-cache ones, alone and after each layer's FP8 GEMMs against the upcasting
# kernel (bench/decode_layers.py --e4m3), then the FP8 1k/1k at 512 sequences without and with
# it (E4M3_PRODUCTS set on in this copy of the tree for the second run).
set -uo pipefail
OUT=${OUT:?}
timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -s \
  tests/gpu/test_fp8_kv_cuda.py -k "e4m3 or fp8_cache_kernels" > "$OUT/tests.txt" 2>&1
grep -E "relative error|passed|failed|Error" "$OUT/tests.txt" | tail -8
for g in "" --gemms; do
  timeout 150 bench/device_env.sh python3 bench/decode_layers.py --e4m3 --placement engine $g \
    --steps 512:1500:1510 512:1025:2047 256:1025:2047 64:129:256 > "$OUT/layers$g.txt" 2>&1
  cut -c1-200 "$OUT/layers$g.txt"
done
L="--model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 1024 --output-len 1024"
Q="--quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512"
for mode in off on; do
  [ $mode = on ] && sed -i 's/^E4M3_PRODUCTS = False/E4M3_PRODUCTS = True/' engine/attention/triton_decode.py
  timeout 150 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L $Q \
    --json "$OUT/fp8-$mode.json" > "$OUT/fp8-$mode.txt" 2>&1
  echo "$mode: $(grep -E '"output_tok_per_s"|"mean_ms"|"count"|"preemptions"' "$OUT/fp8-$mode.txt" | tr -d ' \n')"
done
