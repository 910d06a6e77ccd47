#!/usr/bin/env bash
# Device call 110 (main after call 109's flags landed): act(gate) x up made by the gate_up bf16
# GEMV (`linear.GATED_IN_GEMV`) again: call 108 had Llama-3-8B 4.123 -> 4.100 ms, Qwen3-8B
# flat in a slow round (4.50 both; 4.33 in call 109) and Gemma-3-12B (GeGLU) 7.067 -> 7.69 in
# one round. Two rounds each of Llama-3-8B, Qwen3-8B, Gemma-3-12B (main, gated), then
# Gemma-3-12B's batch-1 trace both ways (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant gated engine/layers/linear.py GATED_IN_GEMV
batch1_variants 2 gemma-3-12b .stage/base /tmp/var/gated
batch1_variants 2 llama-3-8b .stage/base /tmp/var/gated
batch1_variants 2 qwen3-8b .stage/base /tmp/var/gated
batch1_trace gemma-3-12b
mv "$OUT/trace-gemma-3-12b.json.gz" "$OUT/trace-gemma-3-12b-main.json.gz"
flag_on engine/layers/linear.py GATED_IN_GEMV
batch1_trace gemma-3-12b
python3 bench/next/summary.py "$OUT"
