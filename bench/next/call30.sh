#!/usr/bin/env bash
# Device call 30 (~6 min): call 29 found splitting a prompt's keys slower everywhere but for few
# new tokens over many cached (a lone 1,024 prompt: 89.5 us planned, 51.3 whole). Now the keys
# are split to give each SM 4 programs only for queries of <= 64 tokens, 1 otherwise; and a
# step of >= 1,024 prompt tokens sends its decodes to the decode kernel. GPU tests of the
# attention kernels; the splits and mixed steps again; a lone 1,024 prompt step profiled; the
# online row on this tree and on .stage/base (the tree before), one run each.
set -uo pipefail
OUT=${OUT:?}
timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_triton_cuda.py -k "real_shapes and not fused" 2>&1 | tail -1
timeout 100 bench/device_env.sh python3 bench/attention_steps.py --part prompt-splits \
  --splits 1 > "$OUT/splits.txt" 2>&1
grep "splits plan" "$OUT/splits.txt"
timeout 100 bench/device_env.sh python3 bench/attention_steps.py --part mixed > "$OUT/mixed.txt" 2>&1
grep -v eager "$OUT/mixed.txt" | tail -6
timeout 100 bench/device_env.sh python3 bench/profile_prefill.py --prompts 1 --prompt-len 1024 \
  2>&1 | grep -E "prompt tokens a step|_paged_attention|_merge|Self CUDA time"
SUITE=online timeout 150 bench/device_env.sh bash bench/serve_suite.sh "$OUT/after" > /dev/null 2>&1
mkdir -p /tmp/src-before/kvfleet
for c in cli engine gateway operator bench; do ln -sfn "$PWD/.stage/base/$c" /tmp/src-before/kvfleet/$c; done
SUITE=online PYTHONPATH=/tmp/src-before:/tmp/site KVFLEET_HOME=$HOME/kvhome timeout 150 \
  bash .stage/base/bench/serve_suite.sh "$OUT/before" > /dev/null 2>&1
for tree in after before; do
  python3 - "$OUT/$tree/online-4rps.json" "$tree" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine")})
PY
done
