#!/usr/bin/env bash
# On the device machine: one benchmark run on several trees in turn, ROUNDS rounds, in the same
# call (bench/ab.sh for more than two): each TREE a folder holding component folders (engine,
# cli, ...; "." this tree), named by its last path part ("." is "this"):
#   bench/variants.sh 2 OUT_DIR .stage/base /tmp/var-a -- bench latency --model llama-3-8b
# Results OUT_DIR/NAME-ROUND.json.
set -euo pipefail
rounds=$1 out=$2
shift 2
trees=()
while [ "$1" != "--" ]; do trees+=("$1"); shift; done
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export KVFLEET_HOME=$HOME/kvhome PYTHONUNBUFFERED=1
name() { if [ "$1" = . ]; then echo this; else basename "$1"; fi; }
for tree in "${trees[@]}"; do
    src=/tmp/src-var-$(name "$tree")
    mkdir -p "$src/kvfleet"
    for c in cli engine gateway operator bench; do
        if [ -d "$tree/$c" ]; then ln -sfn "$(cd "$tree" && pwd)/$c" "$src/kvfleet/$c"; fi
    done
done
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for tree in "${trees[@]}"; do
        n=$(name "$tree")
        echo "== $n, round $round: $*"
        PYTHONPATH=/tmp/src-var-$n:/tmp/site python3 -m kvfleet.cli.main "$@" --json "$out/$n-$round.json"
    done
done
