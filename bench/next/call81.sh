#!/usr/bin/env bash
# Device call 81 (branch gpu-next22, 64-key splits now): (1) the first tile preloaded before
# the wait up to two decode programs an SM (E) against one (this branch), batch 1 under an
# 8k context (Llama-3-8B and Qwen3-8B: 8 KV heads x 32 splits = 256 programs, not preloaded
# now); (2) batch-1 traces of Llama-3-8B and Qwen3-30B-A3B on this branch (the attention's
# path now; here `python3 bench/next/trace_path.py`). Carry .whl and .stage. ~4 min.
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1 --max-model-len 8192"
mkdir -p /tmp/E && cp -r engine bench cli gateway operator /tmp/E/
sed -i 's/num_splits <= num_sms(q.device)/num_splits <= 2 * num_sms(q.device)/' \
  /tmp/E/engine/attention/triton_decode.py
grep -c "<= 2 \* num_sms(q.device)" /tmp/E/engine/attention/triton_decode.py
for m in llama-3-8b qwen3-8b; do
  (cd /tmp/E && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
     "$OLDPWD" 1 "$OUT/DE-$m-8k" bench latency --model $m $A) > "$OUT/DE-$m.txt" 2>&1
done
for m in llama-3-8b qwen3-30b-a3b; do
  timeout 150 bench/device_env.sh python3 bench/profile_decode.py --model $m --batch-size 1 \
    --trace "$OUT/trace-$m.json" > "$OUT/profile-$m.txt" 2>&1
  gzip -f "$OUT/trace-$m.json"
done
python3 bench/next/summary.py "$OUT"
