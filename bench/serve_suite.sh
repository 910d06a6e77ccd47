#!/usr/bin/env bash
# The online benchmarks of bench/RESULTS.md against a local engine, in one go:
#   bench/serve_suite.sh OUT_DIR [engine flags...]
# Starts `kvfleet engine` (llama-3-8b dummy unless the flags say otherwise), runs
# `kvfleet bench serve` in the modes listed in $SUITE (default: online blocker prefix),
# writes one JSON per run into OUT_DIR, then restarts the engine without prefix caching for
# the shared-prefix comparison. Run it under bench/device_env.sh on the device.
set -euo pipefail
out=$1; shift
mkdir -p "$out"
port=${PORT:-8011}
suite=${SUITE:-online blocker prefix}
url=http://127.0.0.1:$port
engine_pid=

start_engine() {
  python3 -m kvfleet.cli.main engine --model llama-3-8b --load-format dummy --port "$port" \
    --max-model-len 8192 "$@" >"$out/engine-$#.log" 2>&1 &
  engine_pid=$!
  # Ready when /health answers 200; fail at once if the engine dies while loading.
  until python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 "$engine_pid" 2>/dev/null; then
      echo "the engine exited while starting:" >&2; tail -20 "$out/engine-$#.log" >&2; exit 1
    fi
    sleep 1
  done
}
stop_engine() { kill "$engine_pid" 2>/dev/null || true; wait "$engine_pid" 2>/dev/null || true; }
trap stop_engine EXIT
bench() { python3 -m kvfleet.cli.main bench serve --base-url "$url" --vocab-size 128000 "$@"; }

start_engine "$@"
for mode in $suite; do
  case $mode in
    online) bench --mode random --request-rate 4 --num-prompts 120 --input-len 1024 \
      --output-len 256 --json "$out/online-4rps.json" ;;
    blocker) bench --mode blocker --num-prompts 32 --input-len 512 --output-len 256 \
      --blocker-len 4096 --json "$out/blocker.json" ;;
    prefix) bench --mode shared-prefix --prefix-len 3000 --num-prompts 80 --input-len 32 \
      --output-len 16 --request-rate 4 --json "$out/prefix-on.json" ;;
  esac
done
if [[ " $suite " == *" prefix "* ]]; then
  stop_engine
  start_engine --no-prefix-caching "$@"
  bench --mode shared-prefix --prefix-len 3000 --num-prompts 80 --input-len 32 \
    --output-len 16 --request-rate 4 --json "$out/prefix-off.json"
fi
