#!/usr/bin/env bash
# Device call 52: the e4m3 one-row tensor-core GEMV over K tile, K split and pipeline stages
# at Llama-3-8B's layers, then the layer chain with each layer's fastest (bench/fp8_gemv_stages.py).
set -uo pipefail
OUT=${OUT:?}
timeout 500 bench/device_env.sh python3 bench/fp8_gemv_stages.py > "$OUT/stages.txt" 2>&1
grep -E "^(copy|chain|==|[a-z_]+ +floor)" "$OUT/stages.txt"; grep -iE "Traceback|Error" "$OUT/stages.txt" | head -5
