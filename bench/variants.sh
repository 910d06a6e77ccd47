#!/usr/bin/env bash
# On the device machine: one benchmark run on several trees in turn, ROUNDS rounds, in the same
# call. Each TREE is a folder holding component folders (engine, cli, ...; "." this tree),
# named NAME=TREE or by its last path part ("." is "this"):
#   bench/variants.sh 2 OUT_DIR .stage/base /tmp/var/a -- bench latency --model llama-3-8b
# Results OUT_DIR/NAME-ROUND.json. (bench/ab.sh: two trees, after and before.)
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: bench/variants.sh ROUNDS OUT_DIR [NAME=]TREE... -- COMMAND..." >&2
    exit 2
fi
rounds=$1 out=$2
shift 2
names=() trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        *=*) names+=("${1%%=*}") trees+=("${1#*=}") ;;
        .) names+=(this) trees+=(.) ;;
        *) names+=("$(basename "$1")") trees+=("$1") ;;
    esac
    shift
done
if [ $# -eq 0 ]; then
    echo "bench/variants.sh: no -- before the command" >&2
    exit 2
fi
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export KVFLEET_HOME=$HOME/kvhome PYTHONUNBUFFERED=1
for i in "${!trees[@]}"; do
    src=/tmp/src-var-${names[$i]}
    mkdir -p "$src/kvfleet"
    for c in cli engine gateway operator bench; do
        if [ -d "${trees[$i]}/$c" ]; then
            ln -sfn "$(cd "${trees[$i]}" && pwd)/$c" "$src/kvfleet/$c"
        fi
    done
done
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for i in "${!trees[@]}"; do
        n=${names[$i]}
        # (the command moved from kvfleet.engine.cli to kvfleet.cli.main)
        module=kvfleet.cli.main
        [ -d "/tmp/src-var-$n/kvfleet/cli" ] || module=kvfleet.engine.cli
        echo "== $n, round $round: $module $*"
        PYTHONPATH=/tmp/src-var-$n:/tmp/site python3 -m "$module" "$@" --json "$out/$n-$round.json"
    done
done
