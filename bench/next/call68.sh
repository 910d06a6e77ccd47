#!/usr/bin/env bash
# Device call 68 (next session): what holds the e4m3-products attention paths off
# (triton_decode.E4M3_PRODUCTS, triton_prompt.E4M3_PRODUCTS). SmolLM2's GGUF must be in
# $HOME/kvhome first (bench/next/stage_smollm2.sh: two calls while the machine is warm). Runs: their GPU tests (the decode one fixed after
# call 67), the decode kernel's time alone and after each layer's GEMMs beside the upcasting
# one, SmolLM2's FP8-KV quality (perplexity: the prompt path; --decode-perplexity: the decode
# path) upcasting, then with the decode switch on, then both (set on in this copy of the tree),
# then the FP8 1k/1k with both on.
# `call68.sh kernels` runs the tests and the kernel timings only (no model needed), `call68.sh
# serving` the quality and the 1k/1k; no argument both.
set -uo pipefail
OUT=${OUT:?}
part=${1:-all}
if [ "$part" != serving ]; then
timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -s \
  tests/gpu/test_fp8_kv_cuda.py -k "e4m3" > "$OUT/tests.txt" 2>&1
grep -E "relative error|passed|failed|Error" "$OUT/tests.txt" | tail -6
for g in "" --gemms; do
  timeout 200 bench/device_env.sh python3 bench/decode_layers.py --e4m3 --placement engine $g \
    --e4m3-tiles 128,4,2 128,8,3 64,4,3 256,8,2 \
    --steps 512:1500:1510 512:1025:2047 256:1025:2047 64:129:256 > "$OUT/layers$g.txt" 2>&1
  cut -c1-200 "$OUT/layers$g.txt"
done
fi
[ "$part" = kernels ] && exit 0
for mode in off decode both; do
  [ $mode = decode ] && sed -i 's/^E4M3_PRODUCTS = False/E4M3_PRODUCTS = True/' engine/attention/triton_decode.py
  [ $mode = both ] && sed -i 's/^E4M3_PRODUCTS = False/E4M3_PRODUCTS = True/' engine/attention/triton_prompt.py
  timeout 240 bench/device_env.sh python3 -m kvfleet.bench.quality --model smollm2 \
    --kv-cache-dtype fp8 --decode-perplexity --json "$OUT/quality-kv-$mode.json" > "$OUT/quality-$mode.txt" 2>&1
  grep -E "equal|perplexity" "$OUT/quality-$mode.txt"
done
L="--model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 1024 --output-len 1024"
timeout 150 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L --quantization fp8 \
  --kv-cache-dtype fp8 --max-num-seqs 512 --json "$OUT/fp8-on.json" > "$OUT/fp8-on.txt" 2>&1
grep -E '"output_tok_per_s"|"mean_ms"' "$OUT/fp8-on.txt"
