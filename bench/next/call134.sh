#!/usr/bin/env bash
# Device call 134 (session 49's build): which of Qwen3-8B's FP8 layers gain from e4m3 products
# summed in pairs over twice the bf16 plan's inputs (`triton_gemv.PAIRED_E4M3_ROWS`; every
# layer: 2.897 -> 2.800 ms in call 131, one round; at Llama-3-8B every layer lost, 2.663 ->
# 2.737). `bash bench/next/stage.sh` first. Batch 1 FP8, two rounds: this tree / every layer /
# gate_up alone / qkv alone (~7 min). Land the layers that gain; check Llama-3-8B where a shape
# is shared (qkv, o).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
G=engine/layers/triton_gemv.py
paired() {  # NAME SHAPES: this tree with PAIRED_E4M3_ROWS = frozenset({SHAPES})
  variant "$1" && sed -i "s/^PAIRED_E4M3_ROWS: \(.*\) = frozenset()/PAIRED_E4M3_ROWS: \1 = frozenset({$2})/" "/tmp/var/$1/$G"
  grep -n "^PAIRED_E4M3_ROWS" "/tmp/var/$1/$G"
}
paired all "(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)"
paired gate_up "(24576, 4096),"
paired qkv "(6144, 4096),"
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 2 qwen3-8b .stage/base /tmp/var/all \
  /tmp/var/gate_up /tmp/var/qkv
python3 bench/next/summary.py "$OUT"
