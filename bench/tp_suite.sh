#!/usr/bin/env bash
# The tensor-parallel figures of bench/RESULTS.md, on a machine with 2+ GPUs, in one call:
#   bench/device_env.sh bench/tp_suite.sh OUT_DIR [PART...]
# PARTs (default: allreduce tput latency70): allreduce, tput (8B, 256 requests, TP=1 and
# TP=2), tput-sync (the same without asynchronous scheduling), latency70 (70B TP=2 batch 1),
# latency8 (8B TP=1 batch 1), profile70 (70B TP=2 decode profile), agreement (8B TP=2 vs
# TP=1 vs float32). One log per run in OUT_DIR; each run's tail is printed.
set -uo pipefail
out=$1; shift
mkdir -p "$out"
parts=${*:-allreduce tput latency70}
# shellcheck source-path=SCRIPTDIR source=suite_lib.sh
source "$(dirname "$0")/suite_lib.sh"
bench=(python3 -m kvfleet.cli.main bench)
for part in $parts; do
  case $part in
    allreduce) run allreduce python3 bench/allreduce.py --out "$out/allreduce.json" ;;
    tput)
      for tp in 1 2; do
        run "tput-tp$tp" "${bench[@]}" throughput --model llama-3-8b --tensor-parallel-size "$tp" \
          --json "$out/tput-tp$tp.json"
      done ;;
    tput-sync)
      for tp in 1 2; do
        run "tput-sync-tp$tp" "${bench[@]}" throughput --model llama-3-8b --tensor-parallel-size "$tp" \
          --no-async-scheduling --json "$out/tput-sync-tp$tp.json"
      done ;;
    latency70)
      run latency70-tp2 "${bench[@]}" latency --model llama-3-70b --tensor-parallel-size 2 \
        --batch-size 1 --json "$out/latency70-tp2.json" ;;
    latency8)
      run latency8-tp1 "${bench[@]}" latency --model llama-3-8b --batch-size 1 \
        --json "$out/latency8-tp1.json" ;;
    profile70)
      TAIL=60 run profile70-tp2 python3 bench/profile_decode.py --model llama-3-70b \
        --tensor-parallel-size 2 --profile ;;
    agreement)
      run agreement python3 bench/tp_agreement.py --model llama-3-8b --tp 2 ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
