#!/usr/bin/env bash
# Device call 59: where the FP8 + FP8-KV 1k/1k run's time goes at 512 sequences (issue 30's
# 1.8x row): the run with its step timer, a decode step of 512 rows at ~1.5k tokens of KV
# (temperature 1, as the run samples) and a prompt step of 8 x 1,024, each profiled.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
Q="--quantization fp8 --kv-cache-dtype fp8"
timeout 200 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L $Q \
  --num-prompts 1000 --input-len 1024 --output-len 1024 --max-num-seqs 512 \
  --json "$OUT/fp8-512.json" > "$OUT/fp8-512.txt" 2>&1
grep -E "tok_per_s|elapsed|count|mean_ms|total_s|floor|preempt|TFLOPs|copy" "$OUT/fp8-512.txt"
timeout 150 bench/device_env.sh python3 bench/profile_decode.py --batch-size 512 \
  --prompt-len 1500 --temperature 1.0 $Q --profile > "$OUT/decode-512.txt" 2>&1
head -30 "$OUT/decode-512.txt"
timeout 150 bench/device_env.sh python3 bench/profile_prefill.py $Q > "$OUT/prefill.txt" 2>&1
head -12 "$OUT/prefill.txt"
ls -la "$OUT"
