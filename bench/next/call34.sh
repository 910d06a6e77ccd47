#!/usr/bin/env bash
# Device call 34 (main + uvloop/httptools for the engine, ~9 min): the engine served HTTP through
# h11 (pure Python) and asyncio's loop, the device and the engine image having neither uvloop
# nor httptools. The online row, then the shared-prefix row, with them (`fast`) and without
# (`plain`: a sitecustomize makes both unimportable, so uvicorn falls back as before), alternating;
# the client's TTFT against the engine's own says what HTTP costs.
set -uo pipefail
OUT=${OUT:?}
mkdir -p /tmp/plainsite
cat > /tmp/plainsite/sitecustomize.py <<'PY'
import sys
sys.modules["uvloop"] = None  # (an import of either now raises ImportError)
sys.modules["httptools"] = None
PY
bench/device_env.sh python3 -c "import uvloop, httptools; print('fast wheels importable')"
run() {  # run VARIANT SUITE NAME
  local path=/tmp/src:/tmp/site
  [ "$1" = plain ] && path=/tmp/plainsite:$path
  PYTHONPATH=$path KVFLEET_HOME=$HOME/kvhome SUITE=$2 timeout 200 bash bench/serve_suite.sh \
    "$OUT/$3" > /dev/null 2>&1
  for f in "$OUT/$3"/*.json; do
    python3 - "$f" "$3 $(basename "$f" .json)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine") if k in r})
PY
  done
}
run fast "online prefix" fast-1
run plain "online prefix" plain-1
run plain online plain-2
run fast online fast-2
