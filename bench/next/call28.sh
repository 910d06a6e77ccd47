#!/usr/bin/env bash
# Device call 28 (~4 min): where issue 32's online TTFT goes (p50 37-44 ms against <= 30; the
# 1,024-token prompt's matmuls alone ~20 ms at the bf16 peak): one 1,024-token prompt step alone
# beside its FLOP floor, profiled (an eager step: pieces stop at 512 tokens); then the online
# row once (4 req/s, 1,024 -> 256), whose report holds the client's TTFT percentiles and the
# engine's own TTFT mean (from /metrics) to split server time from the HTTP path.
set -uo pipefail
OUT=${OUT:?}
timeout 150 bench/device_env.sh python3 bench/profile_prefill.py --prompts 1 --prompt-len 1024 \
  > "$OUT/prefill.txt" 2>&1
grep -E "prompt tokens a step|Self CUDA|^ +[_a-zA-Z].*(kernel|gemm|nvjet|Kernel)" "$OUT/prefill.txt" | head -24
SUITE=online timeout 240 bench/device_env.sh bash bench/serve_suite.sh "$OUT/online" \
  > "$OUT/online.txt" 2>&1
python3 - "$OUT/online/online-4rps.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: v for k, v in r.items() if "ttft" in k or "itl" in k or k == "engine"})
PY
tail -3 "$OUT/online.txt"
