#!/usr/bin/env bash
# The speculative-decoding figures of bench/RESULTS.md (issue 11), on one GPU, in one call:
#   bench/device_env.sh bench/spec_suite.sh OUT_DIR [PART...]
# (The device brings back at most 8 files: give an OUT_DIR outside $OUT; the suite ends by
# packing it into OUT_DIR.tgz, to copy there.)
# PARTs (default: smol8b tests; tests last, so that nothing a timed-out test leaves running
# shares the GPU with a benchmark): tests (tests/gpu/test_speculative_cuda.py and the graph and
# engine tests it touches), smol (SmolLM2 bf16, document-repeating task, batch 1 and 64: ngram
# k=4, ngram k=8, draft smollm2 k=4), 8b (llama-3-8b dummy bf16 at batch 1 and 64 with ngram k=4
# and a llama-3.2-1b dummy draft), smol8b (smol, then 8b). One log and one JSON per run in OUT_DIR;
# each run's tail is printed.
set -uo pipefail
out=$1; shift
mkdir -p "$out"
parts=${*:-smol8b tests}
# shellcheck source-path=SCRIPTDIR source=suite_lib.sh
source "$(dirname "$0")/suite_lib.sh"
spec() {  # name, then bench speculative arguments
  local name=$1; shift
  run "$name" python3 -m kvfleet.cli.main bench speculative --json "$out/$name.json" "$@"
}
ngram4='{"method": "ngram", "num_speculative_tokens": 4}'
ngram8='{"method": "ngram", "num_speculative_tokens": 8}'
for part in $parts; do
  case $part in
    tests)
      run tests python3 -m pytest -o addopts=--import-mode=importlib -q \
        tests/gpu/test_speculative_cuda.py tests/gpu/test_engine_cuda.py \
        tests/gpu/test_triton_cuda.py tests/gpu/test_lora_cuda.py tests/gpu/test_sampler_cuda.py ;;
    smol|smol8b|8b)
      [[ $part == 8b ]] || for batch in 1 64; do
        spec "smol-ngram4-b$batch" --batch-size "$batch" --speculative-config "$ngram4"
        spec "smol-ngram8-b$batch" --batch-size "$batch" --speculative-config "$ngram8"
        spec "smol-draft4-b$batch" --batch-size "$batch" --speculative-config \
          '{"method": "draft", "model": "smollm2", "num_speculative_tokens": 4}'
      done
      if [[ $part != smol ]]; then
        for batch in 1 64; do
          spec "8b-ngram4-b$batch" --model llama-3-8b --load-format dummy --dtype bfloat16 \
            --batch-size "$batch" --speculative-config "$ngram4"
          spec "8b-draft4-b$batch" --model llama-3-8b --load-format dummy --dtype bfloat16 \
            --batch-size "$batch" --speculative-config \
            '{"method": "draft", "model": "llama-3.2-1b", "num_speculative_tokens": 4}'
        done
      fi ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
