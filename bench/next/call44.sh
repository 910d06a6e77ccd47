#!/usr/bin/env bash
# Device call 44 (next session, ~3 min): call 43 again, then one round each under the torch
# profiler (`--profile`: the host's lead, the GPU's busy time, its gaps and tail from adding the
# prompt to its first token): call 43's lone FP8 prompt took 22-38 ms where `bench latency` timed
# 18.2; is the spread GPU time (clocks, power under FP8 GEMMs) or host time?
PROFILE=--profile exec bash bench/next/call43.sh
