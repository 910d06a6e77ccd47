#!/usr/bin/env bash
# Device call 24 (gpu-next12, ~8 min): LoRA at batch 64 fell to 0.783x base (session 32: the
# adapters add 1.67 ms a step, their bytes 0.16; TTFT 40.6 -> 140.2 ms). The LoRA kernels'
# programs now numbered over the (slot, block) pairs that exist, prefill blocks of 64, and prompt
# steps with adapters replayed in pieces (were eager): GPU tests,
# the kernels alone on both trees (bench/lora_layer.py, the decode sweep of the shrink's split),
# then batch 64 with 8 adapters against main (two rounds), then where the time goes: the LoRA
# decode graph and the cached-prompt step, profiled.
set -uo pipefail
OUT=${OUT:?}
timeout 150 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_lora_cuda.py tests/gpu/test_prefill_graphs_cuda.py \
  > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -6
L="--model llama-3-8b --load-format dummy --batch-size 64 --input-len 512 --output-len 128"
timeout 200 bash bench/ab.sh .stage/base 2 "$OUT/lora" bench latency $L --num-loras 8 \
  --lora-rank 16 --lora-share 1 >> "$OUT/log.txt" 2>&1
for tree in after before; do
  echo "kernels alone, $tree:"
  PYTHONPATH=/tmp/src-$tree:/tmp/site timeout 90 python3 bench/lora_layer.py 2>&1 | tail -8
done
P="bench/device_env.sh python3 bench/profile_decode.py --batch-size 64 --prompt-len 512 --num-loras 8"
timeout 120 $P --profile > "$OUT/decode.txt" 2>&1
grep -E "ms/step|GPU graph|_kernel|gemm|Self CUDA" "$OUT/decode.txt" | head -24
timeout 120 $P --ttft > "$OUT/ttft.txt" 2>&1
grep -E "TTFT|_kernel|gemm|Self C" "$OUT/ttft.txt" | head -30
python3 bench/next/summary.py "$OUT"
