#!/usr/bin/env bash
# Device call 33 (main, ~6 min): is the GIL in the online TTFT? The engine steps in a thread of
# the HTTP server's process; CPython hands the GIL to a waiting thread only after the switch
# interval (5 ms) unless the holder lets go. The online row (4 req/s, 1,024 -> 256) with the
# default interval and with 0.5 ms (set by a sitecustomize on PYTHONPATH), two rounds
# alternating; the client's TTFT against the engine's own says what HTTP and hand-offs cost.
set -uo pipefail
OUT=${OUT:?}
mkdir -p /tmp/gilsite
cat > /tmp/gilsite/sitecustomize.py <<'PY'
import os, sys
if os.environ.get("SWITCH_IV"):
    sys.setswitchinterval(float(os.environ["SWITCH_IV"]))
PY
bench/device_env.sh true
for round in 1 2; do
  for iv in default 0.0005; do
    env $([ $iv = default ] || echo SWITCH_IV=$iv) PYTHONPATH=/tmp/gilsite:/tmp/src:/tmp/site \
      KVFLEET_HOME=$HOME/kvhome SUITE=online timeout 120 bash bench/serve_suite.sh \
      "$OUT/iv-$iv-$round" > /dev/null 2>&1
    python3 - "$OUT/iv-$iv-$round/online-4rps.json" "iv $iv round $round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine")})
PY
  done
done
python3 -c "import sys; print(sys.version)"
