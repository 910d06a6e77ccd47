#!/usr/bin/env bash
# On the device machine: one benchmark run alternately on this tree and on another (the
# previous commit's component folders, e.g. `git archive REV engine gateway operator bench`
# unpacked into a carried folder), in the same call, each writing its JSON result:
#   bench/ab.sh BEFORE_DIR ROUNDS OUT_DIR bench latency --model llama-3-8b --batch-size 1
# Runs after, before, after, before, ... (ROUNDS of each); results OUT_DIR/{after,before}-N.json.
set -euo pipefail
before=$1 rounds=$2 out=$3
shift 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export KVFLEET_HOME=$HOME/kvhome PYTHONUNBUFFERED=1
link() {  # $1: a tree, $2: where its kvfleet namespace goes
    mkdir -p "$2/kvfleet"
    for c in cli engine gateway operator bench; do
        if [ -d "$1/$c" ]; then ln -sfn "$(cd "$1" && pwd)/$c" "$2/kvfleet/$c"; fi
    done
}
link . /tmp/src-after
link "$before" /tmp/src-before
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for tree in after before; do
        # (the command moved from kvfleet.engine.cli to kvfleet.cli.main)
        module=kvfleet.cli.main
        [ -d "/tmp/src-$tree/kvfleet/cli" ] || module=kvfleet.engine.cli
        echo "== $tree, round $round: $module $*"
        PYTHONPATH=/tmp/src-$tree:/tmp/site python3 -m "$module" "$@" --json "$out/$tree-$round.json"
    done
done
