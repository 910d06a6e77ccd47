#!/usr/bin/env bash
# Device call 82 (branch gpu-next22): where decode attention's ~8.5 us on the batch-1 path goes
# (call 81's traces: 8.65 us a layer in Qwen3-30B-A3B, 8.53 in Llama-3-8B, though each split
# is one tile loaded before the wait). Timing only, wrong outputs: F1 = no tile after the wait
# (end = start: no q, K, V loads or products; the partials, counter and merge kept), F2 = also
# one live split (split 0 stores its zeros as the output: the wait, one store, the exit).
# Batch-1 traces; here `python3 bench/next/trace_path.py` on them. ~3 min.
set -uo pipefail
OUT=${OUT:?}
for v in F1 F2; do
  mkdir -p /tmp/$v && cp -r engine bench cli gateway operator /tmp/$v/
  python3 - /tmp/$v/engine/attention/triton_decode.py $v <<'PY'
import sys
path, v = sys.argv[1], sys.argv[2]
s = open(path).read()
old = "    wait_for_previous(PDL)\n    q = tl.load("
assert s.count(old) == 1
s = s.replace(old, "    wait_for_previous(PDL)\n    end = start\n    q = tl.load(")
if v == "F2":
    old = "    live = live_splits(seq_len, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N)\n"
    assert s.count(old) == 1
    s = s.replace(old, "    live = 1\n")
open(path, "w").write(s)
PY
done
for run in F1:qwen3-30b-a3b F2:qwen3-30b-a3b F2:llama-3-8b; do
  v=${run%%:*} m=${run#*:}
  (cd /tmp/$v && ln -sfn "$OLDPWD/.whl" .whl && timeout 150 "$OLDPWD/bench/device_env.sh" python3 bench/profile_decode.py \
     --model $m --batch-size 1 --trace "$OUT/trace-$v-$m.json") > "$OUT/profile-$v-$m.txt" 2>&1
  grep -a "batch 1:" "$OUT/profile-$v-$m.txt"
  gzip -f "$OUT/trace-$v-$m.json"
done
