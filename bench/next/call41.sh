#!/usr/bin/env bash
# Device call 41 (~4 min): issue 32's online and shared-prefix rows (call39.sh's, bf16 there)
# with FP8 weights and an FP8 KV cache: how much of the bf16 TTFT is the 1,024-token prompt's
# matmuls (~21 ms at the measured bf16 peak), which FP8 halves.
set -uo pipefail
SUITE="online prefix" timeout 300 bench/device_env.sh bash bench/serve_suite.sh /tmp/serve-fp8 \
  --quantization fp8 --kv-cache-dtype fp8 > /dev/null 2>&1
for f in /tmp/serve-fp8/*.json; do
  python3 - "$f" "fp8 $(basename "$f" .json)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine") if k in r})
PY
done
grep -h "while serving" /tmp/serve-fp8/engine-*.log | cut -c1-300 | sort | uniq -c
tail -3 /tmp/serve-fp8/engine-*.log | cut -c1-300
