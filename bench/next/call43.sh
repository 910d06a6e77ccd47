#!/usr/bin/env bash
# Device call 43 (~2.5 min): a 1,024-token prompt joining 0, 4 and 8 decoding requests of 1,024
# tokens, in-process, each step timed (bench/mixed_ttft.py), bf16 then FP8 weights + cache:
# call 41's FP8 online row was no faster than bf16's, though a lone FP8 prompt is 40% faster.
set -uo pipefail
for q in "" "--quantization fp8 --kv-cache-dtype fp8"; do
  timeout 140 bench/device_env.sh python3 bench/mixed_ttft.py --decodes 0 4 8 $q ${PROFILE:-} 2>&1 \
    | grep -E "TTFT|Error|error" | tail -8
done
