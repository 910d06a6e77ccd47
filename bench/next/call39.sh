#!/usr/bin/env bash
# Device call 39 (~6 min): a mixed step's decodes (from 32k KV tokens in the decode kernel)
# take a split count launched before (`triton_decode.launched_splits`) instead of their own
# plan, which compiled a new variant mid-serving (call 37's runtime count, kept off: batch 1
# +2.4%). The no-compile GPU test, now with eight 7k prompts at once, on this tree and with the
# change undone (expected to fail, naming the compiled variants); then issue 32's online and
# shared-prefix rows (round 1 of 3: call40.sh runs rounds 2 and 3 with SKIP_TESTS).
set -uo pipefail
OUT=${OUT:?}
no_compiles() {
  timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
    -p no:cacheprovider tests/gpu/test_engine_cuda.py -k no_kernel_compiles 2>&1 \
    | grep -E "passed|failed|compil|Error|assert" | cut -c1-400 | tail -6
}
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== this tree"; no_compiles
  cp engine/attention/triton_decode.py /tmp/triton_decode.py
  sed -i 's/            num_splits = launched_splits(variant, num_splits)/            pass/' \
    engine/attention/triton_decode.py
  echo "== mixed steps' decodes at their own planned count (expected to fail)"; no_compiles
  cp /tmp/triton_decode.py engine/attention/triton_decode.py
fi
for round in ${ROUNDS_LIST:-1}; do
  SUITE="online prefix" timeout 240 bench/device_env.sh bash bench/serve_suite.sh \
    "/tmp/serve-$round" > /dev/null 2>&1
  for f in /tmp/serve-"$round"/*.json; do
    python3 - "$f" "r$round $(basename "$f" .json)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "itl_ms", "engine") if k in r})
PY
  done
  grep -h "while serving" /tmp/serve-"$round"/engine-*.log | cut -c1-300 | sort | uniq -c
done
