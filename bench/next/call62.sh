#!/usr/bin/env bash
# Device call 62: why the FP8 decode kernel takes ~480 us a layer in the engine's 512-row step
# and 380 alone (call 61: placement and pool size change nothing). Each layer's call after the
# layer's four FP8 GEMMs (their own time taken out), and the SM clock and power sampled every
# 20 ms through both runs and an engine decode step's profile.
set -uo pipefail
OUT=${OUT:?}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv,noheader -lms 20 > "$OUT/smi.csv" 2>&1 &
SMI=$!
echo "layers start $(date +%T.%N)"
timeout 300 bench/device_env.sh python3 bench/decode_layers.py --steps 512:1500:1510 \
  --placement engine > "$OUT/alone.txt" 2>&1
timeout 300 bench/device_env.sh python3 bench/decode_layers.py --steps 512:1500:1510 \
  --placement engine --gemms > "$OUT/gemms.txt" 2>&1
echo "engine start $(date +%T.%N)"
timeout 200 bench/device_env.sh python3 bench/profile_decode.py --batch-size 512 \
  --prompt-len 1500 --temperature 1.0 --quantization fp8 --kv-cache-dtype fp8 > "$OUT/decode-512.txt" 2>&1
echo "end $(date +%T.%N)"
kill $SMI
cat "$OUT/alone.txt" "$OUT/gemms.txt" | cut -c1-220
head -8 "$OUT/decode-512.txt"
