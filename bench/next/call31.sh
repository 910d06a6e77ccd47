#!/usr/bin/env bash
# Device call 31 (~4 min): call 30's online row got far worse (TTFT p50 44.6 / p99 1,082 ms
# against 35.4 / 82 before) with a 1,024-token step's decodes sent to the decode kernel (eager);
# that part is reverted. The prompt splits' change alone: the online row on this tree and on
# .stage/base, one run each.
set -uo pipefail
OUT=${OUT:?}
bench/device_env.sh true
SUITE=online PYTHONPATH=/tmp/src:/tmp/site KVFLEET_HOME=$HOME/kvhome timeout 110 \
  bash bench/serve_suite.sh "$OUT/after" > /dev/null 2>&1
mkdir -p /tmp/src-before/kvfleet
for c in cli engine gateway operator bench; do ln -sfn "$PWD/.stage/base/$c" /tmp/src-before/kvfleet/$c; done
SUITE=online PYTHONPATH=/tmp/src-before:/tmp/site KVFLEET_HOME=$HOME/kvhome timeout 110 \
  bash .stage/base/bench/serve_suite.sh "$OUT/before" > /dev/null 2>&1
for tree in after before; do
  python3 - "$OUT/$tree/online-4rps.json" "$tree" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine")})
PY
done
