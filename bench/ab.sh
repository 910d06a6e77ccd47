#!/usr/bin/env bash
# On the device machine: one benchmark run alternately on this tree and on another (the
# previous commit's component folders, e.g. `git archive REV engine gateway operator bench`
# unpacked into a carried folder), in the same call, each writing its JSON result:
#   bench/ab.sh BEFORE_DIR ROUNDS OUT_DIR bench latency --model llama-3-8b --batch-size 1
# Runs after, before, after, before, ... (ROUNDS of each); results OUT_DIR/{after,before}-N.json.
set -euo pipefail
before=$1 rounds=$2 out=$3
shift 3
exec bash "$(dirname "$0")/variants.sh" "$rounds" "$out" after=. before="$before" -- "$@"
